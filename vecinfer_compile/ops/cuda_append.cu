// One decode step's append to a compressed cache layer, in one launch: the new key's transform,
// the encoding of the token that leaves the full-precision window, the code write, the window
// shift and the two counters.
//
// Compiled at run time with NVRTC (see cuda_append.py); no toolkit headers, and no fast-math
// (the key transform divides by lam exactly, as the torch reference does). -D defines:
//   D        head_dim (a multiple of COLS)         COLS   channels per CTA (32)
//   DK, DV   channels per key / value centroid     EK, EV key / value codebook entries
//   KFMT, VFMT  code format: 0 one byte per code, 2 packed 12-bit (see quant/packing.py)
//   FP16     1: key, value and windows are float16; 0: bfloat16
//   MATRIX   0: no matrix; 1: one [D, D] matrix (the Hadamard rotation); 2: one per KV head
//            ([H, D, D], the query-aware key_matrix)
//   MEAN, LAM  1 when the key mean / the smoothing factors are given ([H, D] float32)
//   NTHREADS threads per CTA
//
// Semantics (the torch reference is append_reference in cache_append.py). Per (batch row, KV
// head), with c = n_coded, w = n_window, R the window's slots:
//   k~ = ((key - mean) / lam) @ M, float32, rounded to the window dtype
//   w < R:   window slot w <- (k~, value); n_window = w + 1
//   w == R:  codes at slot c <- encode(window slot 0); slots 1..R-1 move to 0..R-2; slot R-1 <-
//            (k~, value); n_coded = c + 1  (R == 0: codes at slot c <- encode(k~, value))
// Codes of a slot c >= Tmax are not written (the eager path raises before that; the counters
// still advance, as in the reference).
//
// grid (B * H, D / COLS): each CTA owns COLS channels of one row, which holds whole sub-vectors
// (an even number of them, so the packed 12-bit high nibbles of a pair stay in one CTA): the
// transform's output columns, the encode of those sub-vectors, and the window shift of those
// channels are independent of every other CTA. Only the counters are shared: every CTA reads
// them first, and the CTA that arrives last on `arrivals` (zero between launches: that CTA resets
// it) writes them.

#define KSUB (COLS / DK)  // key sub-vectors per CTA
#define VSUB (COLS / DV)
#define SK (D / DK)       // key sub-vectors per head vector
#define SV (D / DV)
#define NWARPS (NTHREADS / 32)
#define PARTS (NTHREADS / COLS)  // threads summing one output column of the transform
#define ROW_QUADS (COLS * 2 / 16)  // 16-byte pieces of one window row's COLS channels
#define SHIFT_UNROLL 4

typedef unsigned short u16;
struct __align__(16) vq_w4 { unsigned x, y, z, w; };

__device__ __forceinline__ float to_float(u16 h) {
#if FP16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((unsigned)h) << 16);
#endif
}

__device__ __forceinline__ u16 from_float(float f) {
    u16 h;
#if FP16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

__host__ __device__ constexpr int row_bytes(int s, int fmt) { return fmt == 0 ? s : s + (s + 1) / 2; }

// (d, i) beats (bd, bi): a smaller distance, or the same one at a smaller index (torch.argmin
// returns the first minimum).
__device__ __forceinline__ bool better(float d, int i, float bd, int bi) {
    return d < bd || (d == bd && i < bi);
}

// Nearest centroid of each of the NSUB sub-vectors x[s * DIM .. (s + 1) * DIM) among the E
// entries of `book` ([E, DIM] float32), by the squared distance summed in channel order as the
// reference does. The CTA's threads split the entries; result in idx[0 .. NSUB).
template <int NSUB, int DIM, int E>
__device__ void nearest(const float* x, const float* __restrict__ book, float (*best_d)[16],
                        int (*best_i)[16], int* idx) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float bd[NSUB];
    int bi[NSUB];
#pragma unroll
    for (int s = 0; s < NSUB; ++s) { bd[s] = __int_as_float(0x7f800000); bi[s] = 0; }
    for (int e = tid; e < E; e += NTHREADS) {
        float c[DIM];
#pragma unroll
        for (int j = 0; j < DIM; ++j) c[j] = book[e * DIM + j];
#pragma unroll
        for (int s = 0; s < NSUB; ++s) {
            float dist = 0.f;
#pragma unroll
            for (int j = 0; j < DIM; ++j) {
                const float diff = x[s * DIM + j] - c[j];
                dist = __fadd_rn(dist, __fmul_rn(diff, diff));
            }
            if (dist < bd[s]) { bd[s] = dist; bi[s] = e; }  // e grows: the first minimum stays
        }
    }
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float od = __shfl_xor_sync(0xffffffffu, bd[s], off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi[s], off);
            if (better(od, oi, bd[s], bi[s])) { bd[s] = od; bi[s] = oi; }
        }
        if (lane == 0) { best_d[warp][s] = bd[s]; best_i[warp][s] = bi[s]; }
    }
    __syncthreads();
    if (tid < NSUB) {
        float d = best_d[0][tid];
        int i = best_i[0][tid];
        for (int w = 1; w < NWARPS; ++w)
            if (better(best_d[w][tid], best_i[w][tid], d, i)) { d = best_d[w][tid]; i = best_i[w][tid]; }
        idx[tid] = i;
    }
    __syncthreads();
}

// Store the NSUB codes of sub-vectors first .. first + NSUB of one position (`row` points at its
// stored codes, S sub-vectors in all) in format FMT.
template <int NSUB, int S, int FMT>
__device__ __forceinline__ void store_codes(unsigned char* row, int first, const int* idx) {
    const int tid = threadIdx.x;
    if (tid < NSUB) row[first + tid] = (unsigned char)(idx[tid] & 0xff);
    if (FMT == 2 && tid < NSUB / 2) {
        const int a = idx[2 * tid] >> 8, b = idx[2 * tid + 1] >> 8;
        row[S + (first >> 1) + tid] = (unsigned char)(a | (b << 4));
    }
}

// Window slots 1 .. R-1 move to 0 .. R-2, this CTA's channels of both windows, in passes that
// load before they store (a pass's targets are its own sources or rows already moved).
__device__ void shift_windows(u16* kw, u16* vw, int R, int c0) {
    const int items = 2 * (R - 1) * ROW_QUADS;  // key rows first, then value rows
    for (int base = 0; base < items; base += NTHREADS * SHIFT_UNROLL) {
        vq_w4 v[SHIFT_UNROLL];
#pragma unroll
        for (int u = 0; u < SHIFT_UNROLL; ++u) {
            const int it = base + u * NTHREADS + threadIdx.x;
            if (it < items) {
                const int tensor = it / ((R - 1) * ROW_QUADS), rest = it % ((R - 1) * ROW_QUADS);
                const int r = 1 + rest / ROW_QUADS, q = rest % ROW_QUADS;
                const u16* src = (tensor ? vw : kw) + (size_t)r * D + c0 + q * 8;
                v[u] = *(const vq_w4*)src;
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < SHIFT_UNROLL; ++u) {
            const int it = base + u * NTHREADS + threadIdx.x;
            if (it < items) {
                const int tensor = it / ((R - 1) * ROW_QUADS), rest = it % ((R - 1) * ROW_QUADS);
                const int r = rest / ROW_QUADS, q = rest % ROW_QUADS;
                *(vq_w4*)((tensor ? vw : kw) + (size_t)r * D + c0 + q * 8) = v[u];
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(NTHREADS) vq_append(
    const u16* __restrict__ key,    // [B * H, D]: the new token's key (before the transform)
    const u16* __restrict__ value,  // [B * H, D]
    unsigned char* __restrict__ k_codes,  // [B * H, Tmax, row_bytes(SK, KFMT)]
    unsigned char* __restrict__ v_codes,  // [B * H, Tmax, row_bytes(SV, VFMT)]
    u16* __restrict__ k_window,  // [B * H, R, D] transformed keys
    u16* __restrict__ v_window,  // [B * H, R, D]
    long long* n_coded, long long* n_window, int* arrivals,
    const float* __restrict__ k_book,  // [EK, DK]
    const float* __restrict__ v_book,  // [EV, DV]
    const float* __restrict__ mean,    // [H, D] or null (MEAN 0)
    const float* __restrict__ lam,     // [H, D] or null (LAM 0)
    const float* __restrict__ matrix,  // [D, D], [H, D, D] or null (MATRIX)
    int H, int Tmax, int R) {
    __shared__ float xs[D];                  // (key - mean) / lam
    __shared__ float partial[PARTS][COLS];   // the transform's per-part column sums
    __shared__ float kflush[COLS], vflush[COLS];  // the leaving token's channels
    __shared__ u16 knew[COLS];               // k~, this CTA's channels, rounded
    __shared__ float best_d[NWARPS][16];
    __shared__ int best_i[NWARPS][16], kidx[KSUB], vidx[VSUB];

    const int row = blockIdx.x, h = row % H, c0 = blockIdx.y * COLS, tid = threadIdx.x;
    const long long c = *n_coded, w = *n_window;
    const bool flush = w >= R;  // the window is full (or there is none): its oldest token leaves
    const u16* krow = key + (size_t)row * D;
    const u16* vrow = value + (size_t)row * D;
    u16* kw = k_window + (size_t)row * R * D;
    u16* vw = v_window + (size_t)row * R * D;

    // 1. the key transform, this CTA's COLS output channels
    for (int i = tid; i < D; i += NTHREADS) {
        float x = to_float(krow[i]);
#if MEAN
        x = x - mean[h * D + i];
#endif
#if LAM
        x = x / lam[h * D + i];
#endif
        xs[i] = x;
    }
    __syncthreads();
#if MATRIX
    {
        const float* m = matrix + (MATRIX == 2 ? (size_t)h * D * D : 0);
        const int j = tid % COLS, part = tid / COLS;
        float acc = 0.f;
#pragma unroll 8
        for (int i = part; i < D; i += PARTS) acc = fmaf(xs[i], m[(size_t)i * D + c0 + j], acc);
        partial[part][j] = acc;
        __syncthreads();
        if (tid < COLS) {
            float sum = 0.f;
#pragma unroll
            for (int p = 0; p < PARTS; ++p) sum += partial[p][tid];
            knew[tid] = from_float(sum);
        }
    }
#else
    if (tid < COLS) knew[tid] = from_float(xs[c0 + tid]);
#endif
    __syncthreads();

    // 2. the leaving token (window slot 0, or the new token itself without a window), encoded
    if (flush) {
        if (tid < COLS) {
            kflush[tid] = to_float(R > 0 ? kw[c0 + tid] : knew[tid]);
            vflush[tid] = to_float(R > 0 ? vw[c0 + tid] : vrow[c0 + tid]);
        }
        __syncthreads();
        nearest<KSUB, DK, EK>(kflush, k_book, best_d, best_i, kidx);
        nearest<VSUB, DV, EV>(vflush, v_book, best_d, best_i, vidx);
        if (c < Tmax) {
            store_codes<KSUB, SK, KFMT>(k_codes + ((size_t)row * Tmax + c) * row_bytes(SK, KFMT), c0 / DK, kidx);
            store_codes<VSUB, SV, VFMT>(v_codes + ((size_t)row * Tmax + c) * row_bytes(SV, VFMT), c0 / DV, vidx);
        }
    }

    // 3. the window: shift out the leaving token, then the new one into its slot
    if (R > 0) {
        if (flush) shift_windows(kw, vw, R, c0);
        const int slot = flush ? R - 1 : (int)w;
        if (tid < COLS) {
            kw[(size_t)slot * D + c0 + tid] = knew[tid];
            vw[(size_t)slot * D + c0 + tid] = vrow[c0 + tid];
        }
    }

    // 4. the counters, by the last CTA to arrive (every CTA has read them by then)
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        if (atomicAdd(arrivals, 1) == (int)(gridDim.x * gridDim.y) - 1) {
            *n_coded = c + (flush ? 1 : 0);
            *n_window = flush ? R : w + 1;
            atomicExch(arrivals, 0);
        }
    }
}
