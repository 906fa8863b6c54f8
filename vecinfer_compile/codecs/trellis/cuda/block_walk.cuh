// The least-squared-error trellis walk of one vector by one CTA, as a device function: the walks of
// viterbi.cu's warp kernel (the same ties: the lowest predecessor, the lowest final state), its
// string in the stored layout (vecinfer_compile/codecs/trellis/packing.py). Prepended by the
// launchers (viterbi.py, trellis_append.py) to the kernels that walk: viterbi_block.cu (a vector a
// CTA) and trellis_append.cu (a decode step's append). No toolkit headers. -D defines:
//   L     state bits (2^L states, 5 <= L)        D     components a vector (head_dim)
//   MAXK  the widest step (<= L)                  MAXB  bytes of the widest string
//   BT    threads a CTA (min(2^L, 512)); each owns the states tid + BT r, r < 2^L / BT
//
// The path costs sit in shared memory (two buffers); a step of k bits has every thread compute its
// new states s' = j << k | new: the cheapest of the 2^k predecessors i * 2^(L-k) + j (read as
// broadcasts: a warp's states share few prefixes j) plus the squared error against the k-bit table
// (each thread's entries read once for a run of steps of one width), then one barrier. The choice
// of each prefix goes to shared memory (a byte, two for steps over 8 bits), read back by one
// thread's walk from the cheapest final state, which only records each step's bits and their place;
// the CTA then writes them into the string. A vector's latency is ~D barriers, not D steps of one
// warp over 2^L states.

#define S (1 << L)
#define SPT (S / BT)  // states a thread
#define NWARPS (BT / 32)
#define INF __int_as_float(0x7f800000)
#define STRING_WORDS ((MAXB + 3) / 4)
// The walk's dynamic shared memory, in this order: costs [2, S] float, the final reduction
// [NWARPS] float and [NWARPS] int, the string [STRING_WORDS] u32, each step's bits and their place
// [D] int, the trace (at most D S / 2 bytes: 2^(L-k) bytes a step of k <= 8 bits, twice that above).
#define WALK_SMEM_BYTES (4 * (2 * S + 2 * NWARPS + STRING_WORDS + D) + D * S / 2)

template <int K>
__device__ __forceinline__ void block_step(const float* prev, float* next, float x, const float (&entry)[SPT],
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
        if ((s & ((1 << K) - 1)) == 0) {
            if constexpr (K > 8) ((unsigned short*)trace)[j] = (unsigned short)arg;
            else trace[j] = (unsigned char)arg;
        }
        const float e = x - entry[r];
        next[s] = m + e * e;
    }
}

__device__ __forceinline__ int trace_bytes(int k) { return (S >> k) * (k > 8 ? 2 : 1); }

// Where block_walk leaves the code string in its shared memory.
__device__ __forceinline__ unsigned* walk_string(unsigned char* walk_smem) {
    return (unsigned*)(walk_smem + 4 * (2 * S + 2 * NWARPS));
}

// Steps t .. end of width K (components of 0 bits among them are skipped): they share one table, so
// each thread reads its states' entries once for the run and no step branches on its width.
template <int K>
__device__ __forceinline__ void walk_run(float* cost, int& cur, const float* xs, const int* ks, int t, int end,
                                         const float* __restrict__ table, unsigned char* trace, int& offset,
                                         int& total_bits, int tid) {
    float entry[SPT];
#pragma unroll
    for (int r = 0; r < SPT; ++r) entry[r] = __ldg(table + tid + r * BT);
    for (; t < end; ++t) {
        if (ks[t] == 0) continue;  // uniform across the CTA
        block_step<K>(cost + cur * S, cost + (cur ^ 1) * S, xs[t], entry, trace + offset, tid);
        __syncthreads();
        cur ^= 1;
        offset += trace_bytes(K);
        total_bits += K;
    }
}

// The walk of xs [D] (unit components) with ks [D] (bits a component, 0: not coded), both in shared
// memory and written before the call; head_tables [W, S] this head's unit tables (row k - 1: the
// k-bit table). `walk_smem` is WALK_SMEM_BYTES of shared memory. Every thread of the CTA calls it;
// on return (after a barrier) the code string is in walk_string(walk_smem), its bytes little-endian
// in the words, zero past its bits.
__device__ void block_walk(const float* xs, const int* ks, const float* __restrict__ head_tables,
                           unsigned char* walk_smem) {
    float* cost = (float*)walk_smem;                            // [2, S]
    float* red_cost = cost + 2 * S;                             // [NWARPS]
    int* red_state = (int*)(red_cost + NWARPS);                 // [NWARPS]
    unsigned* string = walk_string(walk_smem);                  // [STRING_WORDS]
    int* placed = (int*)(string + STRING_WORDS);                // [D] start bit << 16 | the step's bits
    unsigned char* trace = (unsigned char*)(placed + D);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int r = 0; r < SPT; ++r) cost[tid + r * BT] = tid + r * BT == 0 ? 0.0f : INF;
    for (int i = tid; i < STRING_WORDS; i += BT) string[i] = 0u;
    __syncthreads();

    // runs of one width (the allocation's widths come in runs: one switch a run, not a step)
    int cur = 0, offset = 0, total_bits = 0;
    for (int t = 0; t < D;) {
        const int k = ks[t];
        int end = t + 1;
        while (end < D && (ks[end] == k || ks[end] == 0)) ++end;
        switch (k) {
#define CASE(KK) case KK: \
    if constexpr (KK <= MAXK && KK <= L) \
        walk_run<KK>(cost, cur, xs, ks, t, end, head_tables + (KK - 1) * S, trace, offset, total_bits, tid); \
    break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11)
#undef CASE
            default: break;  // a run of 0-bit components
        }
        t = end;
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
            offset -= trace_bytes(kk);
            end -= kk;
            placed[t] = end << 16 | (s & ((1 << kk) - 1));
            const int j = s >> kk;
            const int i = kk > 8 ? ((const unsigned short*)(trace + offset))[j] : trace[offset + j];
            s = j | (i << (L - kk));
        }
    }
    __syncthreads();
    for (int t = tid; t < D; t += BT) {
        const int kk = ks[t];
        if (kk != 0) or_state_bits(string, placed[t] >> 16, kk, placed[t] & 0xffff);
    }
    __syncthreads();
}
