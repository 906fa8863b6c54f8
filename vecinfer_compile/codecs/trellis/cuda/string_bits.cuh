// Writing a trellis walk's code string in shared memory, shared by the walks of viterbi.cu and
// block_walk.cuh (prepended by viterbi.py). The string is big-endian by bit: bit p is bit
// 7 - (p & 7) of byte p >> 3, the bytes little-endian in its 32-bit words
// (vecinfer_compile/codecs/trellis/packing.py); it starts zeroed.

// The word mask of bit p.
__device__ __forceinline__ unsigned string_bit(int p) { return (0x80u >> (p & 7)) << (8 * ((p >> 3) & 3)); }

// Set the kk bits of `fresh` (its most significant first) at bits start .. start + kk of `string`.
__device__ __forceinline__ void put_state_bits(unsigned* string, int start, int kk, int fresh) {
    for (int b = 0; b < kk; ++b)
        if ((fresh >> (kk - 1 - b)) & 1) string[(start + b) >> 5] |= string_bit(start + b);
}

// The same where other threads set the neighbouring bits at the same time.
__device__ __forceinline__ void or_state_bits(unsigned* string, int start, int kk, int fresh) {
    for (int b = 0; b < kk; ++b)
        if ((fresh >> (kk - 1 - b)) & 1) atomicOr(string + ((start + b) >> 5), string_bit(start + b));
}
