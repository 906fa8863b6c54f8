"""The codes of the cache, one package a codec behind one interface (:mod:`.base`), looked up by
name through :mod:`.registry`: :mod:`.codebooks` (the default, VecInfer's k-means codebooks) and
:mod:`.trellis` (a long-block trellis code)."""
