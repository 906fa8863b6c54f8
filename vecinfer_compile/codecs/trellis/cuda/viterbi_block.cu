// The trellis codec's encoder for a few vectors, one CTA a vector (block_walk.cuh, prepended by
// viterbi.py, holds the walk and its -D defines). grid (N, H): the CTA of vector n, head h reads its
// components and the head's bits into shared memory, walks, and writes the stored string.

extern "C" __global__ void __launch_bounds__(BT)
trellis_viterbi_block(const float* __restrict__ x,       // [N, H, D] unit components, contiguous
                      const int* __restrict__ bits,      // [H, D] bits of each component, contiguous
                      const float* __restrict__ tables,  // [H, W, S] unit tables, contiguous
                      unsigned char* __restrict__ codes, // [N, H, nbytes] contiguous
                      int heads, int widths, int nbytes) {
    extern __shared__ __align__(16) unsigned char walk_smem[];  // WALK_SMEM_BYTES
    __shared__ float xs[D];
    __shared__ int ks[D];
    const int tid = threadIdx.x, h = blockIdx.y;
    const long long vec = (long long)blockIdx.x * heads + h;
    for (int i = tid; i < D; i += BT) {
        xs[i] = x[vec * D + i];
        ks[i] = bits[h * D + i];
    }
    block_walk(xs, ks, tables + (long long)h * widths * S, walk_smem);
    const unsigned char* bytes = (const unsigned char*)walk_string(walk_smem);
    for (int i = tid; i < nbytes; i += BT) codes[vec * nbytes + i] = bytes[i];
}
