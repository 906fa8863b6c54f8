"""The Triton kernels (Inductor-visible through ``wrap_triton``): attention over codes
(:mod:`.attention`), decode attention (:mod:`.decode`), a prefix's dequantization
(:mod:`.dequant`) and encoding (:mod:`.encode`); :mod:`.common` holds their shared tiles and the
launch path. On the CPU they run under ``TRITON_INTERPRET=1`` (tests only)."""
