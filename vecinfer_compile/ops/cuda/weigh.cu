// Score-aware and error-weighted codes of head vectors on the GPU (the torch references are
// quant/score_aware.py and quant/weighted_codes.py): one CTA of NTHREADS threads per head vector.
//
// Compiled at run time with NVRTC (see weigh.py); no toolkit headers. -D defines:
//   D            head_dim
//   DK, EK, KFMT the (key) book: channels per centroid, entries, code format (0 one byte per
//                code, 2 packed 12-bit, see quant/packing.py); vq_weigh_rows uses this book only
//   DV, EV, VFMT the value book (vq_weigh_flush)
//   XFMT         input dtype: 0 float32, 1 float16, 2 bfloat16
//   NTHREADS     threads per CTA (a multiple of 32, at least D / DK and D / DV)
//   SWEEPS       sweeps of coordinate descent (weighted_codes.SWEEPS)
//
// Kernels:
//   vq_weigh_rows   codes of rows x [N, D] (row n belongs to KV head (n / T) % H), lowered under
//                   the head's metric from the stored codes `start` [N, W]: the prefill's
//                   vecinfer::weigh_codes.
//   vq_weigh_flush  the codes of the token a decode step's append moves out of the window (window
//                   slot 0 when n_window >= R > 0): the key's score-aware start (or nearest
//                   codes for weight 1) and the value's nearest codes, each lowered under its
//                   metric when one is given, written at code slot n_coded (if below Tmax).
//                   grid (B * H, 2): y = 0 the key, y = 1 the value. It runs before the append
//                   kernel, which then skips its own encode (append.cu, ENCODE 0) and shifts
//                   the window.
//
// The loss of a head vector x (code domain) and its dequantized x_hat, r = x - x_hat, u = x / |x|:
//   loss = r^T M r + (w - 1) (r . u)^2          (M: [D, D] symmetric, the head's metric)
// The descent (weighted_codes._descend) visits sub-vectors s = 0 .. S-1 SWEEPS times; sub-vector s
// takes the entry of the lowest
//   c^T M_ss c - 2 c . z + (w - 1) (alpha - u_s . c)^2,  z = (M r)_s + M_ss x_hat_s,
//   alpha = r . u + x_hat_s . u_s
// if it is strictly lower than its current code's, else keeps its code. M r is kept in shared
// memory and updated when a code changes (D x d multiply-adds), so a step costs one pass over the
// entries and two barriers. Arithmetic order differs from torch's, so near-ties may resolve the
// other way; the tests compare losses.

#define NWARPS (NTHREADS / 32)
#define NSCALES 13  // score_aware.SCALES


__constant__ float kScales[NSCALES] = {0.9f, 0.95f, 1.0f, 1.05f, 1.1f, 1.15f, 1.2f, 1.25f, 1.3f, 1.4f, 1.5f, 1.7f, 2.0f};

__host__ __device__ constexpr int row_bytes(int s, int fmt) { return fmt == 0 ? s : s + (s + 1) / 2; }

#if XFMT == 0
typedef float xtype;
__device__ __forceinline__ float to_float(float v) { return v; }
#else
typedef u16 xtype;
__device__ __forceinline__ float to_float(u16 h) { return half_bits_to_float(h, XFMT == 1); }
#endif

// A float's bits as an unsigned integer of the same order (-0 sorts just below +0).
__device__ __forceinline__ unsigned ordered(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned warp_min(unsigned v) {
    unsigned out;
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(out) : "r"(v));
    return out;
}

// (d, i) beats (bd, bi): a smaller loss, or the same one at a smaller index (torch's argmin
// returns the first minimum).
__device__ __forceinline__ bool better(float d, int i, float bd, int bi) {
    return d < bd || (d == bd && i < bi);
}

// The smallest (loss, index) over the CTA, ties to the smaller index, returned to every thread.
// red_l / red_i: [NWARPS] shared scratch, free again after the caller's next barrier.
__device__ __forceinline__ void block_argmin(float loss, int index, float* red_l, int* red_i, float& out_l, int& out_i) {
    const unsigned key = ordered(loss);
    const unsigned kmin = warp_min(key);
    const unsigned imin = warp_min(key == kmin ? (unsigned)index : 0xffffffffu);
    float wl = loss;
    // the lane holding the warp's best has key == kmin; its loss is the warp's
    const int src = __ffs(__ballot_sync(0xffffffffu, key == kmin && (unsigned)index == imin)) - 1;
    wl = __shfl_sync(0xffffffffu, wl, src);
    if ((threadIdx.x & 31) == 0) { red_l[threadIdx.x >> 5] = wl; red_i[threadIdx.x >> 5] = (int)imin; }
    __syncthreads();
    float bl = red_l[0];
    int bi = red_i[0];
#pragma unroll
    for (int w = 1; w < NWARPS; ++w)
        if (better(red_l[w], red_i[w], bl, bi)) { bl = red_l[w]; bi = red_i[w]; }
    out_l = bl;
    out_i = bi;
}

// The sum of one value per thread, to every thread (red: [NWARPS] shared scratch; two barriers).
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) total += red[w];
    __syncthreads();
    return total;
}

template <int DIM, int E, int FMT>
struct Book {
    static constexpr int S = D / DIM;               // sub-vectors per head vector
    static constexpr int W = row_bytes(S, FMT);     // stored bytes per head vector
    static constexpr int PARTS = NTHREADS / S;      // threads scanning the entries of one sub-vector
};

__device__ __forceinline__ int load_code(const unsigned char* row, int s, int S, int fmt) {
    int code = row[s];
    if (fmt == 2) code |= ((row[S + (s >> 1)] >> ((s & 1) * 4)) & 0xF) << 8;
    return code;
}

template <int S, int FMT>
__device__ __forceinline__ void store_codes(unsigned char* row, const int* idx) {
    const int tid = threadIdx.x;
    if (tid < S) row[tid] = (unsigned char)(idx[tid] & 0xff);
    if (FMT == 2 && tid < (S + 1) / 2) {
        const int a = idx[2 * tid] >> 8, b = 2 * tid + 1 < S ? idx[2 * tid + 1] >> 8 : 0;
        row[S + tid] = (unsigned char)(a | (b << 4));
    }
}

// Start codes into idx[S]: the nearest centroid of each sub-vector (NSC 1, the squared distance
// summed in channel order), or the score-aware codes (NSC NSCALES: for each scale a the nearest
// codes of a x, by |c|^2 - 2 a x.c; the head vector keeps the scale of the lowest
// |r|^2 + (w - 1)(r . u)^2, the earlier on ties). xs: the head vector in shared memory.
template <int DIM, int E, int FMT, int NSC>
struct StartScratch {
    static constexpr int S = Book<DIM, E, FMT>::S, P = Book<DIM, E, FMT>::PARTS;
    float part_d[NSC][P][S];
    int part_i[NSC][P][S];
    int cand[NSC][S];
    float term_sq[NSC][S], term_rx[NSC][S];
};

template <int DIM>
struct MetricRows {
    float rows[2][DIM][D];  // a step's DIM rows of M and the next step's
};

__host__ __device__ constexpr int max3(int a, int b, int c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

// Bytes of shared scratch a book needs: its start search, then (reusing them) its descent's rows
// of M. The key's and the value's share one pool.
template <int DIM, int E, int FMT>
__host__ __device__ constexpr int pool_bytes() {
    return max3((int)sizeof(StartScratch<DIM, E, FMT, NSCALES>), (int)sizeof(StartScratch<DIM, E, FMT, 1>),
                (int)sizeof(MetricRows<DIM>));
}

template <int DIM, int E, int FMT, int NSC>
__device__ void start_codes(const float* xs, const float* __restrict__ book, float weight, int* idx, void* pool) {
    typedef Book<DIM, E, FMT> B;
    constexpr int S = B::S, P = B::PARTS;
    StartScratch<DIM, E, FMT, NSC>& sc = *reinterpret_cast<StartScratch<DIM, E, FMT, NSC>*>(pool);
    auto& part_d = sc.part_d;
    auto& part_i = sc.part_i;
    auto& cand = sc.cand;
    auto& term_sq = sc.term_sq;
    auto& term_rx = sc.term_rx;
    __shared__ float red[NWARPS];
    const int tid = threadIdx.x, s = tid % S, q = tid / S;
    float x[DIM];
#pragma unroll
    for (int j = 0; j < DIM; ++j) x[j] = xs[s * DIM + j];
    float bd[NSC];
    int bi[NSC];
#pragma unroll
    for (int k = 0; k < NSC; ++k) { bd[k] = __int_as_float(0x7f800000); bi[k] = 0; }
    if (q < P) {
#pragma unroll 4
        for (int e = q; e < E; e += P) {
            float c[DIM];
#pragma unroll
            for (int j = 0; j < DIM; ++j) c[j] = __ldg(book + e * DIM + j);
            if constexpr (NSC == 1) {
                float dist = 0.f;
#pragma unroll
                for (int j = 0; j < DIM; ++j) {
                    const float diff = x[j] - c[j];
                    dist = __fadd_rn(dist, __fmul_rn(diff, diff));
                }
                if (dist < bd[0]) { bd[0] = dist; bi[0] = e; }
            } else {
                float cc = 0.f, dot = 0.f;
#pragma unroll
                for (int j = 0; j < DIM; ++j) { cc = fmaf(c[j], c[j], cc); dot = fmaf(x[j], c[j], dot); }
#pragma unroll
                for (int k = 0; k < NSC; ++k) {
                    const float v = fmaf(-2.f * kScales[k], dot, cc);
                    if (v < bd[k]) { bd[k] = v; bi[k] = e; }
                }
            }
        }
#pragma unroll
        for (int k = 0; k < NSC; ++k) { part_d[k][q][s] = bd[k]; part_i[k][q][s] = bi[k]; }
    }
    __syncthreads();
    if constexpr (NSC == 1) {
        if (tid < S) {
            float d = part_d[0][0][tid];
            int i = part_i[0][0][tid];
            for (int p = 1; p < P; ++p)
                if (better(part_d[0][p][tid], part_i[0][p][tid], d, i)) { d = part_d[0][p][tid]; i = part_i[0][p][tid]; }
            idx[tid] = i;
        }
        __syncthreads();
        return;
    } else {
    // per (scale, sub-vector): the best of the parts, and its terms of the head vector's loss
    for (int t = tid; t < NSC * S; t += NTHREADS) {
        const int k = t / S, sv = t % S;
        float d = part_d[k][0][sv];
        int i = part_i[k][0][sv];
        for (int p = 1; p < P; ++p)
            if (better(part_d[k][p][sv], part_i[k][p][sv], d, i)) { d = part_d[k][p][sv]; i = part_i[k][p][sv]; }
        cand[k][sv] = i;
        float sq = 0.f, rx = 0.f;
#pragma unroll
        for (int j = 0; j < DIM; ++j) {
            const float xv = xs[sv * DIM + j], r = xv - __ldg(book + i * DIM + j);
            sq = fmaf(r, r, sq);
            rx = fmaf(r, xv, rx);
        }
        term_sq[k][sv] = sq;
        term_rx[k][sv] = rx;
    }
    float xx = 0.f;
    for (int i = tid; i < D; i += NTHREADS) xx = fmaf(xs[i], xs[i], xx);
    xx = block_sum(xx, red);  // its barriers also order the terms above
    __shared__ int chosen;
    if (tid < 32) {
        const float norm = fmaxf(sqrtf(xx), 1.17549435e-38f);
        float loss = __int_as_float(0x7f800000);
        if (tid < NSC) {
            float sq = 0.f, rx = 0.f;
            for (int sv = 0; sv < S; ++sv) { sq += term_sq[tid][sv]; rx += term_rx[tid][sv]; }
            const float along = rx / norm;
            loss = sq + (weight - 1.f) * along * along;
        }
        const unsigned key = ordered(loss);
        const unsigned kmin = warp_min(key);
        const unsigned kbest = warp_min(key == kmin ? (unsigned)tid : 0xffffffffu);  // the earlier scale on ties
        if (tid == 0) chosen = (int)kbest;
    }
    __syncthreads();
    if (tid < S) idx[tid] = cand[chosen][tid];
    __syncthreads();
    }
}

// SWEEPS sweeps of coordinate descent on idx[S] (see the header). xs: the head vector; m: the
// head's metric [D, D] (symmetric). The rows of M a step reads (its sub-vector's DIM rows: the
// block M_ss and the columns of the M r update) are loaded into shared memory one step ahead, so
// that no step waits for L2; a thread's own entries stay in registers when they are few.
template <int DIM, int E, int FMT>
__device__ void descend(const float* xs, const float* __restrict__ book, const float* __restrict__ m, float weight,
                        int* idx, void* pool) {
    typedef Book<DIM, E, FMT> B;
    constexpr int S = B::S;
    constexpr int EPT = (E + NTHREADS - 1) / NTHREADS;     // entries per thread
    constexpr bool CACHED = EPT * DIM <= 16;               // held in registers
    constexpr int PRE = (DIM * D + NTHREADS - 1) / NTHREADS;  // M values a thread prefetches per step
    __shared__ float xh[D], y[D], u[D];
    auto& mrow = reinterpret_cast<MetricRows<DIM>*>(pool)->rows;
    __shared__ float red[NWARPS], red_l[NWARPS];
    __shared__ int red_i[NWARPS];
    __shared__ float ru;  // r . u
    const int tid = threadIdx.x;
    const float parallel = weight - 1.f;
    float creg[CACHED ? EPT : 1][DIM];
    if constexpr (CACHED) {
#pragma unroll
        for (int k = 0; k < EPT; ++k)
#pragma unroll
            for (int j = 0; j < DIM; ++j) creg[k][j] = tid + k * NTHREADS < E ? __ldg(book + (tid + k * NTHREADS) * DIM + j) : 0.f;
    }
    for (int t = tid; t < DIM * D; t += NTHREADS) mrow[0][t / D][t % D] = __ldg(m + t);  // rows of sub-vector 0
    float xx = 0.f;
    for (int i = tid; i < D; i += NTHREADS) {
        xh[i] = __ldg(book + idx[i / DIM] * DIM + i % DIM);
        xx = fmaf(xs[i], xs[i], xx);
    }
    xx = block_sum(xx, red);
    const float inv_norm = 1.f / fmaxf(sqrtf(xx), 1.17549435e-38f);
    float rudot = 0.f;
    for (int i = tid; i < D; i += NTHREADS) {
        u[i] = xs[i] * inv_norm;
        float acc = 0.f;
#pragma unroll 16
        for (int j = 0; j < D; ++j) acc = fmaf(__ldg(m + (size_t)j * D + i), xs[j] - xh[j], acc);
        y[i] = acc;
        rudot = fmaf(xs[i] - xh[i], u[i], rudot);
    }
    rudot = block_sum(rudot, red);
    if (tid == 0) ru = rudot;
    __syncthreads();
    int buf = 0;
#pragma unroll 1
    for (int sweep = 0; sweep < SWEEPS; ++sweep) {
#pragma unroll 1
        for (int s = 0; s < S; ++s, buf ^= 1) {
            // the next step's rows, on their way while this step runs
            const int next = s + 1 == S ? 0 : s + 1;
            float pre[PRE];
#pragma unroll
            for (int u2 = 0; u2 < PRE; ++u2) {
                const int t = tid + u2 * NTHREADS;
                pre[u2] = t < DIM * D ? __ldg(m + (size_t)next * DIM * D + t) : 0.f;
            }
            float mb[DIM][DIM], xsl[DIM], z[DIM], us[DIM];
            float alpha = ru;
#pragma unroll
            for (int j = 0; j < DIM; ++j) {
                xsl[j] = xh[s * DIM + j];
                us[j] = u[s * DIM + j];
#pragma unroll
                for (int k = 0; k < DIM; ++k) mb[j][k] = mrow[buf][j][s * DIM + k];
            }
#pragma unroll
            for (int j = 0; j < DIM; ++j) {
                float acc = y[s * DIM + j];
#pragma unroll
                for (int k = 0; k < DIM; ++k) acc = fmaf(mb[j][k], xsl[k], acc);
                z[j] = acc;
                alpha = fmaf(xsl[j], us[j], alpha);
            }
            auto loss_at = [&](const float* c) {
                float cmc = 0.f, cz = 0.f, uc = 0.f;
#pragma unroll
                for (int j = 0; j < DIM; ++j) {
                    float mc = 0.f;
#pragma unroll
                    for (int k = 0; k < DIM; ++k) mc = fmaf(mb[j][k], c[k], mc);
                    cmc = fmaf(c[j], mc, cmc);
                    cz = fmaf(c[j], z[j], cz);
                    uc = fmaf(us[j], c[j], uc);
                }
                float loss = fmaf(-2.f, cz, cmc);
                if (parallel != 0.f) {
                    const float a = alpha - uc;
                    loss = fmaf(parallel * a, a, loss);
                }
                return loss;
            };
            auto loss_of = [&](int e) {
                float c[DIM];
#pragma unroll
                for (int j = 0; j < DIM; ++j) c[j] = __ldg(book + e * DIM + j);
                return loss_at(c);
            };
            float bl = __int_as_float(0x7f800000);
            int bi = 0x7fffffff;
            if constexpr (CACHED) {
#pragma unroll
                for (int k = 0; k < EPT; ++k) {
                    if (tid + k * NTHREADS < E) {
                        const float l = loss_at(creg[k]);
                        if (l < bl) { bl = l; bi = tid + k * NTHREADS; }
                    }
                }
            } else {
#pragma unroll 2
                for (int e = tid; e < E; e += NTHREADS) {
                    const float l = loss_of(e);
                    if (l < bl) { bl = l; bi = e; }
                }
            }
            const int cur = idx[s];
            const float cur_loss = loss_of(cur);
            block_argmin(bl, bi, red_l, red_i, bl, bi);
            if (bl < cur_loss) {  // uniform across the CTA
                float delta[DIM];
#pragma unroll
                for (int j = 0; j < DIM; ++j) delta[j] = xsl[j] - __ldg(book + bi * DIM + j);  // change of r_s
                for (int i = tid; i < D; i += NTHREADS) {
                    float acc = y[i];
#pragma unroll
                    for (int j = 0; j < DIM; ++j) acc = fmaf(mrow[buf][j][i], delta[j], acc);  // M symmetric
                    y[i] = acc;
                }
                if (tid < DIM) xh[s * DIM + tid] = __ldg(book + bi * DIM + tid);
                if (tid == 0) {
                    float du = 0.f;
#pragma unroll
                    for (int j = 0; j < DIM; ++j) du = fmaf(delta[j], us[j], du);
                    ru = ru + du;
                    idx[s] = bi;
                }
            }
#pragma unroll
            for (int u2 = 0; u2 < PRE; ++u2) {
                const int t = tid + u2 * NTHREADS;
                if (t < DIM * D) mrow[buf ^ 1][t / D][t % D] = pre[u2];
            }
            __syncthreads();
        }
    }
}

// One head vector: x (global, D values of xtype) -> codes in `out` (a row of W bytes). `start`
// (stored codes) or null: compute the start codes (score-aware for weight != 1). `metric` ([D, D]
// of this head) or null: no descent.
template <int DIM, int E, int FMT>
__device__ void weigh_vector(const xtype* __restrict__ x, const unsigned char* __restrict__ start,
                             const float* __restrict__ book, const float* __restrict__ metric, float weight,
                             unsigned char* out, void* pool) {
    typedef Book<DIM, E, FMT> B;
    __shared__ float xs[D];
    __shared__ int idx[B::S];
    const int tid = threadIdx.x;
    for (int i = tid; i < D; i += NTHREADS) xs[i] = to_float(x[i]);
    if (start != nullptr && tid < B::S) idx[tid] = load_code(start, tid, B::S, FMT);
    __syncthreads();
    if (start == nullptr) {
        if (weight != 1.f) start_codes<DIM, E, FMT, NSCALES>(xs, book, weight, idx, pool);
        else start_codes<DIM, E, FMT, 1>(xs, book, weight, idx, pool);
    }
    if (metric != nullptr) descend<DIM, E, FMT>(xs, book, metric, weight, idx, pool);
    store_codes<B::S, FMT>(out, idx);
}

extern "C" __global__ void __launch_bounds__(NTHREADS) vq_weigh_rows(
    const xtype* __restrict__ x,              // [N, D]
    const unsigned char* __restrict__ start,  // [N, W] stored codes
    unsigned char* __restrict__ out,          // [N, W]
    const float* __restrict__ book,           // [EK, DK]
    const float* __restrict__ metric,         // [H, D, D]
    float weight, int H, int T) {
    typedef Book<DK, EK, KFMT> B;
    __shared__ __align__(16) unsigned char pool[pool_bytes<DK, EK, KFMT>()];
    const long long n = blockIdx.x;
    const int h = (int)((n / T) % H);
    weigh_vector<DK, EK, KFMT>(x + n * D, start + n * B::W, book, metric + (size_t)h * D * D, weight, out + n * B::W, pool);
}

extern "C" __global__ void __launch_bounds__(NTHREADS) vq_weigh_flush(
    const xtype* __restrict__ k_window,  // [B * H, R, D] transformed keys
    const xtype* __restrict__ v_window,  // [B * H, R, D]
    unsigned char* __restrict__ k_codes, // [B * H, Tmax, row_bytes(D / DK, KFMT)]
    unsigned char* __restrict__ v_codes, // [B * H, Tmax, row_bytes(D / DV, VFMT)]
    const long long* __restrict__ n_coded, const long long* __restrict__ n_window,
    const float* __restrict__ k_book,    // [EK, DK]
    const float* __restrict__ v_book,    // [EV, DV]
    const float* __restrict__ k_metric,  // [H, D, D] or null
    const float* __restrict__ v_metric,  // [H, D, D] or null
    float k_weight, int H, int Tmax, int R) {
    constexpr int KB = pool_bytes<DK, EK, KFMT>(), VB = pool_bytes<DV, EV, VFMT>();
    __shared__ __align__(16) unsigned char pool[KB > VB ? KB : VB];
    const long long c = *n_coded, w = *n_window;
    if (w < R || c >= Tmax) return;  // nothing leaves the window, or its codes are not stored
    const int row = blockIdx.x, h = row % H;
    const size_t at = (size_t)row * R * D;
    if (blockIdx.y == 0) {
        typedef Book<DK, EK, KFMT> B;
        weigh_vector<DK, EK, KFMT>(k_window + at, nullptr, k_book, k_metric ? k_metric + (size_t)h * D * D : nullptr,
                                   k_weight, k_codes + ((size_t)row * Tmax + c) * B::W, pool);
    } else {
        typedef Book<DV, EV, VFMT> B;
        weigh_vector<DV, EV, VFMT>(v_window + at, nullptr, v_book, v_metric ? v_metric + (size_t)h * D * D : nullptr,
                                   1.f, v_codes + ((size_t)row * Tmax + c) * B::W, pool);
    }
}
