"""The trellis codec's CUDA kernels (NVRTC, :mod:`vecinfer_compile.ops.cuda.nvrtc`): decode attention
(:mod:`.decode`), the Viterbi encoder (:mod:`.viterbi`) and the decode-step append (:mod:`.append`);
``string_bits.cuh`` (a code string's bits) and ``block_walk.cuh`` (the walk of one CTA a vector) are
their shared headers."""
