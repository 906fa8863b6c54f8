"""The CUDA C++ kernels, compiled at run time with NVRTC (:mod:`.nvrtc`) and launched on torch's
current stream: decode attention (:mod:`.decode`), the decode-step append (:mod:`.append`), the
chunk prefix's dequantization (:mod:`.dequant`), the error-weighted encoder (:mod:`.weigh`), and
the trellis codec's decode attention (:mod:`.trellis_decode`), Viterbi encoder (:mod:`.viterbi`) and
decode-step append (:mod:`.trellis_append`). Each module holds its launcher, the builds its inputs choose, and why a call cannot run
(``unsupported_reason``, ``build_error``); the ``.cu`` source sits beside it. Device code that
several kernels share is in headers prepended to their source: ``half_bits.cuh`` (the 16-bit float
conversions), ``string_bits.cuh`` (a trellis code string's bits) and ``block_walk.cuh`` (the trellis
walk of one CTA a vector)."""
