// Dequantization of stored VQ codes into a position-major workspace (the chunk attention's prefix).
//
// Compiled at run time with NVRTC (see dequant.py); no toolkit headers. Compile-time
// parameters as -D defines:
//   D     head_dim                      DIM   channels per centroid (2, 4 or 8)
//   E     codebook entries (<= 4096)    FMT   code format: 0 one byte per code (E <= 256), 2 packed
//                                             12-bit (the low bytes of the S codes, then ceil(S / 2)
//                                             bytes of high nibbles, code 2i in the low nibble)
//   NTHREADS  threads per CTA
//
// vq_dequant: grid (ctas per row, B * H). Each CTA copies the codebook (16-bit, converted once by
// the launcher) into shared memory, then walks positions t = blockIdx.x * PPC + ... of its (b, h)
// row in steps of gridDim.x * PPC, PPC = positions per CTA pass. A thread owns CPT = 16 / DIM
// consecutive codes of one position (32 bytes of output): it reads their bytes, gathers CPT
// centroids from shared memory and writes 32 contiguous bytes with two 16-byte stores. The kernel
// is bound by the output's write bandwidth: the gathers are served by shared memory, the codes
// are an eighth of the bytes at 2 bits.

#define S (D / DIM)                    // codes per position
#define CPT (16 / DIM)                 // codes per thread: 32 bytes of 16-bit output
#define TPP (S / CPT)                  // threads per position
#define PPC (NTHREADS / TPP)           // positions per CTA pass
#define ROW (FMT == 0 ? S : S + (S + 1) / 2)  // stored bytes per position

struct __align__(16) dq_w4 { unsigned x, y, z, w; };
struct __align__(8) dq_w2 { unsigned x, y; };

// The DIM / 2 words of centroid c from the shared-memory book, one vector load.
__device__ __forceinline__ void centroid(const unsigned short* sbook, unsigned c, unsigned* w) {
    if (DIM == 8) {
        const dq_w4 v = ((const dq_w4*)sbook)[c];
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if (DIM == 4) {
        const dq_w2 v = ((const dq_w2*)sbook)[c];
        w[0] = v.x; w[1] = v.y;
    } else {
        w[0] = ((const unsigned*)sbook)[c];
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
vq_dequant(const unsigned char* __restrict__ codes,   // [B, H, Tmax, ROW], strides in bytes below
           const unsigned short* __restrict__ book,   // [E, DIM] 16-bit, contiguous, 16-byte aligned
           unsigned short* __restrict__ out,          // [B, T, H, D], strides in elements below
           int s_cb, int s_ch, int s_ct, int s_ob, int s_ot, int s_oh,  // 32-bit (the launcher's ints)
           int heads, int length) {
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* sbook = (unsigned short*)smem;
    // the codebook: E * DIM 16-bit values, 16 bytes per thread per step
    const int words = E * DIM / 8;
    for (int i = threadIdx.x; i < words; i += NTHREADS) ((dq_w4*)sbook)[i] = ((const dq_w4*)book)[i];
    __syncthreads();
    const int bh = blockIdx.y, b = bh / heads, h = bh - b * heads;
    const int sub = threadIdx.x % TPP, s0 = sub * CPT;
    const unsigned char* row0 = codes + (long long)b * s_cb + (long long)h * s_ch;
    unsigned short* out0 = out + (long long)b * s_ob + (long long)h * s_oh + s0 * DIM;
    for (int t = blockIdx.x * PPC + threadIdx.x / TPP; t < length; t += gridDim.x * PPC) {
        const unsigned char* row = row0 + (long long)t * s_ct;
        unsigned idx[CPT];
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
            unsigned c = row[s0 + j];
            if (FMT == 2) c |= ((row[S + ((s0 + j) >> 1)] >> (((s0 + j) & 1) * 4)) & 0xfu) << 8;
            idx[j] = c;
        }
        unsigned w[8];  // 32 bytes: CPT centroids of DIM 16-bit channels
#pragma unroll
        for (int j = 0; j < CPT; ++j) centroid(sbook, idx[j], w + j * (DIM / 2));
        dq_w4* dst = (dq_w4*)(out0 + (long long)t * s_ot);
        dst[0] = dq_w4{w[0], w[1], w[2], w[3]};
        dst[1] = dq_w4{w[4], w[5], w[6], w[7]};
    }
}
