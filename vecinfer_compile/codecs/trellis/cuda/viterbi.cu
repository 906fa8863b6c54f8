// The trellis codec's encoder, one warp a vector: least-squared-error walks of a bitshift trellis
// (vecinfer_compile/codecs/trellis/walk.py), written in the stored layout
// (vecinfer_compile/codecs/trellis/packing.py; by string_bits.cuh, prepended). Compiled at run time
// with NVRTC (viterbi.py); no toolkit headers. Compile-time parameters as -D defines:
//   L     state bits (2^L states, 5 <= L)        D     components a vector (head_dim)
//   MAXK  the widest step (<= L)                  MAXB  bytes of the widest string
//   WPB   warps (vectors) a block                 TW    trace words a warp (D * the widest step's)
//
// trellis_viterbi_warp: grid (ceil(N / WPB), H); warp w of block (x, h) codes vector x * WPB + w
// of head h. Lane `lane` holds the path costs of states s = lane + 32 r (r < R = 2^L / 32) in
// registers. A step of k bits: each prefix j (the low L - k bits of a predecessor) keeps the
// cheapest of its 2^k predecessors s = i * M + j (M = 2^(L-k); the lowest i on ties), then the
// new state s' = j << k | new costs best[j] plus its squared error against the k-bit table (read
// through L1). With M >= 32 the predecessors of a prefix lie in one lane (a min over registers);
// with M < 32 a butterfly over lanes finishes it. The new costs read best[s' >> k] by one shuffle
// a register (its source register is fixed for each r, so the costs never leave registers). The
// choices go to shared memory as ballots, k words for each 32 prefixes, so a vector's whole trace
// is a few KB and the walk back (one lane) reads no global memory. No block barrier: each warp is
// on its own.

#define S (1 << L)
#define R (S / 32)
#define FULL 0xffffffffu

template <int K>
__device__ __forceinline__ void step(float (&c)[R], float x, const float* __restrict__ table, unsigned* trace,
                                     int lane) {
    constexpr int M = S >> K;
    if constexpr (M >= 32) {
        constexpr int RJ = M / 32;
        float best[RJ];
#pragma unroll
        for (int rj = 0; rj < RJ; ++rj) {
            float m = c[rj];
            int arg = 0;
#pragma unroll
            for (int i = 1; i < (1 << K); ++i) {
                const float v = c[rj + i * RJ];
                if (v < m) { m = v; arg = i; }
            }
            best[rj] = m;
#pragma unroll
            for (int b = 0; b < K; ++b) {
                const unsigned word = __ballot_sync(FULL, (arg >> b) & 1);
                if (lane == 0) trace[rj * K + b] = word;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int src = ((lane + 32 * r) >> K) & 31;
            const float b = __shfl_sync(FULL, best[r >> K], src);
            const float e = x - __ldg(table + 32 * r + lane);
            c[r] = b + e * e;
        }
    } else {
        constexpr int SHIFT = L - K;  // i = s >> SHIFT
        float m = c[0];
        int arg = lane >> SHIFT;
#pragma unroll
        for (int r = 1; r < R; ++r) {
            if (c[r] < m) { m = c[r]; arg = (lane + 32 * r) >> SHIFT; }
        }
#pragma unroll
        for (int off = M; off < 32; off <<= 1) {
            const float om = __shfl_xor_sync(FULL, m, off);
            const int oa = __shfl_xor_sync(FULL, arg, off);
            if (om < m || (om == m && oa < arg)) { m = om; arg = oa; }
        }
#pragma unroll
        for (int b = 0; b < K; ++b) {
            const unsigned word = __ballot_sync(FULL, (arg >> b) & 1);
            if (lane == 0) trace[b] = word;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int src = ((lane + 32 * r) >> K) & 31;
            const float b = __shfl_sync(FULL, m, src);
            const float e = x - __ldg(table + 32 * r + lane);
            c[r] = b + e * e;
        }
    }
}

__device__ __forceinline__ int trace_words(int k) {
    const int m = S >> k;
    return k * (m >= 32 ? m / 32 : 1);
}

extern "C" __global__ void __launch_bounds__(32 * WPB)
trellis_viterbi_warp(const float* __restrict__ x,       // [N, H, D] unit components, contiguous
                     const int* __restrict__ bits,      // [H, D] bits of each component, contiguous
                     const float* __restrict__ tables,  // [H, W, S] unit tables, contiguous
                     unsigned char* __restrict__ codes, // [N, H, nbytes] contiguous
                     int n, int heads, int widths, int nbytes) {
    __shared__ unsigned trace_all[WPB][TW];
    __shared__ unsigned string_all[WPB][(MAXB + 3) / 4];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * WPB + warp, h = blockIdx.y;
    if (row >= n) return;
    unsigned* trace = trace_all[warp];
    unsigned* string = string_all[warp];
    const long long vec = (long long)row * heads + h;
    const float* xv = x + vec * D;
    const int* kv = bits + h * D;
    const float* head_tables = tables + (long long)h * widths * S;

    float c[R];
#pragma unroll
    for (int r = 0; r < R; ++r) c[r] = (r == 0 && lane == 0) ? 0.0f : __int_as_float(0x7f800000);

    int offset = 0, total_bits = 0;
    int k = __ldg(kv);
    float xt = __ldg(xv);
    for (int t = 0; t < D; ++t) {
        const int k_next = t + 1 < D ? __ldg(kv + t + 1) : 0;
        const float x_next = t + 1 < D ? __ldg(xv + t + 1) : 0.0f;
        if (k > 0) {
            const float* table = head_tables + (k - 1) * S;
            unsigned* tr = trace + offset;
            switch (k) {
#define CASE(KK) case KK: if constexpr (KK <= MAXK && KK <= L) step<KK>(c, xt, table, tr, lane); break;
                CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
                CASE(13)
#undef CASE
                default: break;
            }
            offset += trace_words(k);
            total_bits += k;
        }
        k = k_next;
        xt = x_next;
    }

    // the cheapest final state (the lowest on ties)
    float m = c[0];
    int arg = lane;
#pragma unroll
    for (int r = 1; r < R; ++r) {
        if (c[r] < m) { m = c[r]; arg = lane + 32 * r; }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float om = __shfl_xor_sync(FULL, m, off);
        const int oa = __shfl_xor_sync(FULL, arg, off);
        if (om < m || (om == m && oa < arg)) { m = om; arg = oa; }
    }
    for (int i = lane; i < (MAXB + 3) / 4; i += 32) string[i] = 0;
    __syncwarp();
    if (lane == 0) {
        int s = arg, end = total_bits;
        for (int t = D - 1; t >= 0; --t) {
            const int kk = __ldg(kv + t);
            if (kk == 0) continue;
            offset -= trace_words(kk);
            const int start = end - kk;
            put_state_bits(string, start, kk, s & ((1 << kk) - 1));
            const int j = s >> kk;
            const unsigned* w = trace + offset + (j >> 5) * kk;
            int hi = 0;
            for (int b = 0; b < kk; ++b) hi |= ((w[b] >> (j & 31)) & 1) << b;
            s = j | (hi << (L - kk));
            end = start;
        }
    }
    __syncwarp();
    const unsigned char* bytes = (const unsigned char*)string;
    for (int i = lane; i < nbytes; i += 32) codes[vec * nbytes + i] = bytes[i];
}
