// The trellis codec's encoder for a few vectors, one CTA a vector: the same least-squared-error
// walks as viterbi.cu's warp kernel (the same ties: the lowest predecessor, the lowest final
// state), written in the stored layout (vecinfer_compile/quant/trellis_packing.py). Compiled at run
// time with NVRTC (viterbi.py); no toolkit headers. Compile-time parameters as -D defines:
//   L     state bits (2^L states, 5 <= L)        D     components a vector (head_dim)
//   MAXK  the widest step (<= L, <= 8)            MAXB  bytes of the widest string
//   BT    threads a CTA (min(2^L, 1024)); each owns the states tid + BT r, r < 2^L / BT
//
// trellis_viterbi_block: grid (N, H). The path costs sit in shared memory (two buffers); a step of
// k bits has every thread compute its new states s' = j << k | new: the cheapest of the 2^k
// predecessors i * 2^(L-k) + j (read as broadcasts: a warp's states share few prefixes j) plus the
// squared error against the k-bit table (coalesced reads), then one barrier. The choice of each
// prefix goes to shared memory as a byte (2^(L-k) a step; steps of at most 8 bits), read back by
// one thread's walk from the cheapest final state. A vector's latency is ~D barriers, not D steps
// of one warp over 2^L states.

#define S (1 << L)
#define SPT (S / BT)                         // states a thread
#define NWARPS (BT / 32)
#define INF __int_as_float(0x7f800000)

template <int K>
__device__ __forceinline__ void block_step(const float* prev, float* next, float x, const float* __restrict__ table,
                                           unsigned char* trace, int tid) {
    constexpr int M = S >> K;
#pragma unroll
    for (int r = 0; r < SPT; ++r) {
        const int s = tid + r * BT, j = s >> K;
        float m = prev[j];
        int arg = 0;
#pragma unroll 16
        for (int i = 1; i < (1 << K); ++i) {
            const float v = prev[i * M + j];
            if (v < m) { m = v; arg = i; }
        }
        if ((s & ((1 << K) - 1)) == 0) trace[j] = (unsigned char)arg;
        const float e = x - __ldg(table + s);
        next[s] = m + e * e;
    }
}

extern "C" __global__ void __launch_bounds__(BT)
trellis_viterbi_block(const float* __restrict__ x,       // [N, H, D] unit components, contiguous
                      const int* __restrict__ bits,      // [H, D] bits of each component, contiguous
                      const float* __restrict__ tables,  // [H, W, S] unit tables, contiguous
                      unsigned char* __restrict__ codes, // [N, H, nbytes] contiguous
                      int heads, int widths, int nbytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* cost = (float*)smem;                        // [2, S]
    float* xs = cost + 2 * S;                          // [D]
    int* ks = (int*)(xs + D);                          // [D]
    float* red_cost = (float*)(ks + D);                // [NWARPS]
    int* red_state = (int*)(red_cost + NWARPS);        // [NWARPS]
    unsigned* string = (unsigned*)(red_state + NWARPS);   // [(MAXB + 3) / 4]
    unsigned char* trace = (unsigned char*)(string + (MAXB + 3) / 4);  // [D * S / 2] at most
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, h = blockIdx.y;
    const long long vec = (long long)blockIdx.x * heads + h;
    for (int i = tid; i < D; i += BT) {
        xs[i] = x[vec * D + i];
        ks[i] = bits[h * D + i];
    }
#pragma unroll
    for (int r = 0; r < SPT; ++r) cost[tid + r * BT] = tid + r * BT == 0 ? 0.0f : INF;
    for (int i = tid; i < (MAXB + 3) / 4; i += BT) string[i] = 0u;
    __syncthreads();

    const float* head_tables = tables + (long long)h * widths * S;
    int cur = 0, offset = 0, total_bits = 0;
    for (int t = 0; t < D; ++t) {
        const int k = ks[t];
        if (k == 0) continue;  // uniform across the CTA
        const float* prev = cost + cur * S;
        float* next = cost + (cur ^ 1) * S;
        const float* table = head_tables + (k - 1) * S;
        switch (k) {
#define CASE(KK) case KK: \
    if constexpr (KK <= MAXK && KK <= L && KK <= 8) block_step<KK>(prev, next, xs[t], table, trace + offset, tid); \
    break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
            default: break;
        }
        __syncthreads();
        cur ^= 1;
        offset += S >> k;
        total_bits += k;
    }

    // the cheapest final state (the lowest on ties)
    const float* final_cost = cost + cur * S;
    float m = final_cost[tid];
    int arg = tid;
#pragma unroll
    for (int r = 1; r < SPT; ++r) {
        const float v = final_cost[tid + r * BT];
        if (v < m) { m = v; arg = tid + r * BT; }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float om = __shfl_xor_sync(0xffffffffu, m, off);
        const int oa = __shfl_xor_sync(0xffffffffu, arg, off);
        if (om < m || (om == m && oa < arg)) { m = om; arg = oa; }
    }
    if (lane == 0) { red_cost[warp] = m; red_state[warp] = arg; }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < NWARPS; ++w) {
            if (red_cost[w] < m || (red_cost[w] == m && red_state[w] < arg)) { m = red_cost[w]; arg = red_state[w]; }
        }
        int s = arg, end = total_bits;
        for (int t = D - 1; t >= 0; --t) {
            const int kk = ks[t];
            if (kk == 0) continue;
            offset -= S >> kk;
            const int start = end - kk, fresh = s & ((1 << kk) - 1);
            // the string is big-endian by bit: bit p is bit 7 - (p & 7) of byte p >> 3; bytes
            // little-endian in the 32-bit words
            for (int b = 0; b < kk; ++b) {
                if ((fresh >> (kk - 1 - b)) & 1) {
                    const int p = start + b;
                    string[p >> 5] |= (0x80u >> (p & 7)) << (8 * ((p >> 3) & 3));
                }
            }
            const int j = s >> kk;
            s = j | ((int)trace[offset + j] << (L - kk));
            end = start;
        }
    }
    __syncthreads();
    const unsigned char* bytes = (const unsigned char*)string;
    for (int i = tid; i < nbytes; i += BT) codes[vec * nbytes + i] = bytes[i];
}
