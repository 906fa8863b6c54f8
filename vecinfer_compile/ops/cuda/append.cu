// One decode step's append to a compressed cache layer, in one launch: the new key's transform,
// the encoding of the token that leaves the full-precision window, the code write, the window
// shift and the two counters.
//
// Compiled at run time with NVRTC (see append.py); no toolkit headers, and no fast-math
// (the key transform divides by lam exactly, as the torch reference does). -D defines:
//   D        head_dim (a multiple of COLS)         COLS   channels per CTA (32)
//   DK, DV   channels per key / value centroid     EK, EV key / value codebook entries
//   KFMT, VFMT  code format: 0 one byte per code, 2 packed 12-bit (see quant/packing.py)
//   FP16     1: key, value and windows are float16; 0: bfloat16
//   MATRIX   0: no matrix; 1: one [D, D] matrix (the Hadamard rotation); 2: one per KV head
//            ([H, D, D], the query-aware key_matrix)
//   MEAN, LAM  1 when the key mean / the smoothing factors are given ([H, D] float32)
//   NTHREADS threads per CTA
//   ENCODE   1: encode the leaving token here (nearest centroids); 0: its codes were written by
//            vq_weigh_flush (weigh.cu) launched just before, for score-aware or error-weighted
//            codes, and this kernel only moves the window and the counters
//
// Semantics (the torch reference is append_reference in ops/append.py). Per (batch row, KV
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
// it) writes them. Every global read that does not depend on another (the token, the transform's
// inputs, the window rows that move, the first centroids) is issued at the start, so that a launch
// waits for about one round trip rather than one per step (docs/results/decode-speed.md times the append).

#define KSUB (COLS / DK)  // key sub-vectors per CTA
#define VSUB (COLS / DV)
#define SK (D / DK)       // key sub-vectors per head vector
#define SV (D / DV)
#define NWARPS (NTHREADS / 32)
#define SCAN_BATCH 8  // centroids a thread loads at once when scanning a large book
#define PARTS (NTHREADS / COLS)  // threads summing one output column of the transform
#define ROW_QUADS (COLS * 2 / 16)  // 16-byte pieces of one window row's COLS channels

struct __align__(16) vq_w4 { unsigned x, y, z, w; };

__host__ __device__ constexpr int row_bytes(int s, int fmt) { return fmt == 0 ? s : s + (s + 1) / 2; }

// (d, i) beats (bd, bi): a smaller distance, or the same one at a smaller index (torch.argmin
// returns the first minimum).
__device__ __forceinline__ bool better(float d, int i, float bd, int bi) {
    return d < bd || (d == bd && i < bi);
}

// The centroids a thread scans first (entries tid + NTHREADS * i, i < FIRST), loaded at the
// kernel's start so that their round trip overlaps the key transform; a book with more entries
// than FIRST * NTHREADS loads the rest in the scan.
template <int DIM, int E>
struct FirstEntries {
    static constexpr int FIRST = (E + NTHREADS - 1) / NTHREADS < 2 ? (E + NTHREADS - 1) / NTHREADS : 2;
    float c[FIRST][DIM];

    __device__ __forceinline__ void load(const float* __restrict__ book) {
#pragma unroll
        for (int i = 0; i < FIRST; ++i) {
            const int e = threadIdx.x + i * NTHREADS;
#pragma unroll
            for (int j = 0; j < DIM; ++j) c[i][j] = e < E ? book[e * DIM + j] : 0.f;
        }
    }
};

// One centroid against the NSUB sub-vectors: the squared distance summed in channel order, as
// the reference does; e grows along a thread's scan, so the first minimum stays.
template <int NSUB, int DIM>
__device__ __forceinline__ void consider(const float* x, const float* c, int e, float* bd, int* bi) {
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
        float dist = 0.f;
#pragma unroll
        for (int j = 0; j < DIM; ++j) {
            const float diff = x[s * DIM + j] - c[j];
            dist = __fadd_rn(dist, __fmul_rn(diff, diff));
        }
        if (dist < bd[s]) { bd[s] = dist; bi[s] = e; }
    }
}

// Nearest centroid of each of the NSUB sub-vectors x[s * DIM .. (s + 1) * DIM) among the E
// entries of `book` ([E, DIM] float32), first half: each thread scans its entries (the first ones
// already in `first`), each warp reduces, and lane 0 writes the warp's best to best_d / best_i
// [NWARPS][NSUB]. nearest_merge finishes it after a barrier.
template <int NSUB, int DIM, int E>
__device__ __forceinline__ void nearest_scan(const float* x, const FirstEntries<DIM, E>& first,
                                             const float* __restrict__ book, float* best_d, int* best_i) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int F = FirstEntries<DIM, E>::FIRST;
    float bd[NSUB];
    int bi[NSUB];
#pragma unroll
    for (int s = 0; s < NSUB; ++s) { bd[s] = __int_as_float(0x7f800000); bi[s] = 0; }
#pragma unroll
    for (int i = 0; i < F; ++i)
        if (tid + i * NTHREADS < E) consider<NSUB, DIM>(x, first.c[i], tid + i * NTHREADS, bd, bi);
    // The rest (4096-entry books), SCAN_BATCH entries per thread loaded before any is compared.
#pragma unroll 1
    for (int e0 = tid + F * NTHREADS; e0 < E; e0 += SCAN_BATCH * NTHREADS) {
        float c[SCAN_BATCH][DIM];
#pragma unroll
        for (int u = 0; u < SCAN_BATCH; ++u)
#pragma unroll
            for (int j = 0; j < DIM; ++j) c[u][j] = e0 + u * NTHREADS < E ? book[(e0 + u * NTHREADS) * DIM + j] : 0.f;
#pragma unroll
        for (int u = 0; u < SCAN_BATCH; ++u)
            if (e0 + u * NTHREADS < E) consider<NSUB, DIM>(x, c[u], e0 + u * NTHREADS, bd, bi);
    }
#pragma unroll
    for (int s = 0; s < NSUB; ++s) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float od = __shfl_xor_sync(0xffffffffu, bd[s], off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi[s], off);
            if (better(od, oi, bd[s], bi[s])) { bd[s] = od; bi[s] = oi; }
        }
        if (lane == 0) { best_d[warp * NSUB + s] = bd[s]; best_i[warp * NSUB + s] = bi[s]; }
    }
}

// Second half, by threads t0 .. t0 + NSUB: the best of the warps' bests, into idx[0 .. NSUB).
template <int NSUB>
__device__ __forceinline__ void nearest_merge(const float* best_d, const int* best_i, int t0, int* idx) {
    const int s = threadIdx.x - t0;
    if (s < 0 || s >= NSUB) return;
    float d = best_d[s];
    int i = best_i[s];
    for (int w = 1; w < NWARPS; ++w)
        if (better(best_d[w * NSUB + s], best_i[w * NSUB + s], d, i)) { d = best_d[w * NSUB + s]; i = best_i[w * NSUB + s]; }
    idx[s] = i;
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

// Window slots 1 .. R-1 move to 0 .. R-2 (this CTA's channels of both windows), as 2 (R - 1) ROW_QUADS
// 16-byte pieces: key rows first, then value rows, in row order. Piece `it` of row r (r >= 1) moves to row
// r - 1. The kernel loads the first pass (SHIFT_FIRST pieces per thread) at its start; any further
// pass loads before it stores, and a pass's targets are its own sources or rows already moved.
#define SHIFT_FIRST 8
struct ShiftPass {
    vq_w4 v[SHIFT_FIRST];

    __device__ __forceinline__ static u16* piece(u16* kw, u16* vw, int it, int R, int c0, int row_offset) {
        const int tensor = it / ((R - 1) * ROW_QUADS), rest = it % ((R - 1) * ROW_QUADS);
        const int r = 1 + rest / ROW_QUADS - row_offset, q = rest % ROW_QUADS;
        return (tensor ? vw : kw) + (size_t)r * D + c0 + q * 8;
    }

    __device__ __forceinline__ void load(u16* kw, u16* vw, int R, int c0, int base) {
        const int items = 2 * (R - 1) * ROW_QUADS;
#pragma unroll
        for (int u = 0; u < SHIFT_FIRST; ++u) {
            const int it = base + u * NTHREADS + threadIdx.x;
            if (it < items) v[u] = *(const vq_w4*)piece(kw, vw, it, R, c0, 0);
        }
    }

    __device__ __forceinline__ void store(u16* kw, u16* vw, int R, int c0, int base) const {
        const int items = 2 * (R - 1) * ROW_QUADS;
#pragma unroll
        for (int u = 0; u < SHIFT_FIRST; ++u) {
            const int it = base + u * NTHREADS + threadIdx.x;
            if (it < items) *(vq_w4*)piece(kw, vw, it, R, c0, 1) = v[u];
        }
    }
};

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
    __shared__ float kbest_d[NWARPS * KSUB], vbest_d[NWARPS * VSUB];
    __shared__ int kbest_i[NWARPS * KSUB], vbest_i[NWARPS * VSUB], kidx[KSUB], vidx[VSUB];

    const int row = blockIdx.x, h = row % H, c0 = blockIdx.y * COLS, tid = threadIdx.x;
    const u16* krow = key + (size_t)row * D;
    const u16* vrow = value + (size_t)row * D;
    u16* kw = k_window + (size_t)row * R * D;
    u16* vw = v_window + (size_t)row * R * D;

    // 0. Every global read that does not depend on another is issued first, so that the kernel
    // waits for one round trip, not one per step: the counters, the new token, the transform's
    // inputs, the window's oldest slot and the shift's first pass (read whether or not the window
    // is full: the slots exist), the first centroids of both books.
    const long long c = *n_coded, w = *n_window;
    constexpr int KPER = (D + NTHREADS - 1) / NTHREADS;
    float kx[KPER];
#pragma unroll
    for (int u = 0; u < KPER; ++u) {
        const int i = tid + u * NTHREADS;
        if (i < D) {
            float x = half_bits_to_float(krow[i], FP16);
#if MEAN
            x = x - mean[h * D + i];
#endif
#if LAM
            x = x / lam[h * D + i];
#endif
            kx[u] = x;
        }
    }
#if MATRIX
    const int mj = tid % COLS, mpart = tid / COLS;
    float mcol[D / PARTS];  // matrix rows mpart, mpart + PARTS, ..., column c0 + mj
    {
        const float* m = matrix + (MATRIX == 2 ? (size_t)h * D * D : 0);
#pragma unroll
        for (int u = 0; u < D / PARTS; ++u) mcol[u] = m[(size_t)(mpart + u * PARTS) * D + c0 + mj];
    }
#endif
    u16 vnew = 0, kold = 0, vold = 0;
    if (tid < COLS) {
        vnew = vrow[c0 + tid];
        if (R > 0) { kold = kw[c0 + tid]; vold = vw[c0 + tid]; }
    }
    ShiftPass shift;
    if (R > 1) shift.load(kw, vw, R, c0, 0);
#if ENCODE
    FirstEntries<DK, EK> kfirst;
    FirstEntries<DV, EV> vfirst;
    kfirst.load(k_book);
    vfirst.load(v_book);
#endif
    const bool flush = w >= R;  // the window is full (or there is none): its oldest token leaves

    // 1. the key transform, this CTA's COLS output channels
#pragma unroll
    for (int u = 0; u < KPER; ++u)
        if (tid + u * NTHREADS < D) xs[tid + u * NTHREADS] = kx[u];
    __syncthreads();
#if MATRIX
    {
        float acc = 0.f;
#pragma unroll
        for (int u = 0; u < D / PARTS; ++u) acc = fmaf(xs[mpart + u * PARTS], mcol[u], acc);
        partial[mpart][mj] = acc;
        __syncthreads();
        if (tid < COLS) {
            float sum = 0.f;
#pragma unroll
            for (int p = 0; p < PARTS; ++p) sum += partial[p][tid];
            knew[tid] = float_to_half_bits(sum, FP16);
        }
    }
#else
    if (tid < COLS) knew[tid] = float_to_half_bits(xs[c0 + tid], FP16);
#endif
    __syncthreads();

    // 2. the leaving token (window slot 0, or the new token itself without a window), encoded
#if ENCODE
    if (flush) {
        if (tid < COLS) {
            kflush[tid] = half_bits_to_float(R > 0 ? kold : knew[tid], FP16);
            vflush[tid] = half_bits_to_float(R > 0 ? vold : vnew, FP16);
        }
        __syncthreads();
        nearest_scan<KSUB, DK, EK>(kflush, kfirst, k_book, kbest_d, kbest_i);
        nearest_scan<VSUB, DV, EV>(vflush, vfirst, v_book, vbest_d, vbest_i);
        __syncthreads();
        nearest_merge<KSUB>(kbest_d, kbest_i, 0, kidx);
        nearest_merge<VSUB>(vbest_d, vbest_i, 32, vidx);
        __syncthreads();
        if (c < Tmax) {
            store_codes<KSUB, SK, KFMT>(k_codes + ((size_t)row * Tmax + c) * row_bytes(SK, KFMT), c0 / DK, kidx);
            store_codes<VSUB, SV, VFMT>(v_codes + ((size_t)row * Tmax + c) * row_bytes(SV, VFMT), c0 / DV, vidx);
        }
    }
#endif

    // 3. the window: shift out the leaving token (the first pass from registers, any further pass
    // loads before it stores), then the new one into its slot
    if (R > 0) {
        if (flush && R > 1) {
            const int items = 2 * (R - 1) * ROW_QUADS;
            shift.store(kw, vw, R, c0, 0);
            for (int base = NTHREADS * SHIFT_FIRST; base < items; base += NTHREADS * SHIFT_FIRST) {
                __syncthreads();
                shift.load(kw, vw, R, c0, base);
                __syncthreads();
                shift.store(kw, vw, R, c0, base);
            }
            __syncthreads();
        }
        const int slot = flush ? R - 1 : (int)w;
        if (tid < COLS) {
            kw[(size_t)slot * D + c0 + tid] = knew[tid];
            vw[(size_t)slot * D + c0 + tid] = vnew;
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
