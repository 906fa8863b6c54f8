"""The CUDA C++ kernels of the shared op families, compiled at run time with NVRTC (:mod:`.nvrtc`)
and launched on torch's current stream: decode attention (:mod:`.decode`), the decode-step append
(:mod:`.append`), the chunk prefix's dequantization (:mod:`.dequant`) and the error-weighted
encoder (:mod:`.weigh`). Each module holds its launcher, the builds its inputs choose, and why a
call cannot run (``unsupported_reason``, ``build_error``); the ``.cu`` source sits beside it. Device
code that several kernels share is in headers prepended to their source: ``half_bits.cuh`` (the
16-bit float conversions, also read by codecs' own kernels, :mod:`vecinfer_compile.codecs`)."""
