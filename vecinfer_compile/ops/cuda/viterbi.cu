// The trellis codec's encoder: least-squared-error walks of a bitshift trellis, written in the
// stored layout (vecinfer_compile/quant/trellis_packing.py).
//
// Compiled at run time with NVRTC (see viterbi.py); no toolkit headers. Compile-time parameters
// as -D defines:
//   L         state bits (2^L states)         D   components a vector (head_dim)
//   NTHREADS  threads per CTA                 MAXB  bytes of the widest string (D * L / 8, rounded up)
//   WIDE      1 where a step may take more than 8 bits (its predecessors' high bits: 16-bit trace)
//
// trellis_viterbi: grid (N, H), one CTA a vector (a token's components of one KV head). The path
// costs of the 2^L states live in shared memory. A step of k bits (the head's allocation; 0: the
// component is skipped) is the reference's move (vecinfer_compile/quant/trellis.py) in two
// phases: each of the 2^(L-k) prefixes j keeps the cheapest of its 2^k predecessors
// cost[j | hi << (L - k)] (the lowest hi on ties; hi goes to the trace), then every new state
// s = j << k | new costs best[j] plus its squared error against the k-bit table. The trace (one
// byte a prefix and step, two with WIDE; 2^(L-k) a step) stays in shared memory, so the walk back by one thread
// after the last step reads no global memory; it writes each component's new bits (the state's
// low k) at its place in the string, most significant bit first. The steps are sequential: the
// kernel is latency-bound (two barriers a step), which shared memory keeps short.

#define S (1 << L)
#if WIDE
typedef unsigned short trace_t;
#else
typedef unsigned char trace_t;
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS)
trellis_viterbi(const float* __restrict__ x,          // [N, H, D] unit components, contiguous
                const int* __restrict__ bits,         // [H, D] bits of each component, contiguous
                const float* __restrict__ tables,     // [H, W, S] unit tables, contiguous
                unsigned char* __restrict__ codes,    // [N, H, nbytes] contiguous
                int heads, int widths, int nbytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* cost = (float*)smem;                      // [S]
    float* next = cost + S;                          // [S]
    float* best = next + S;                          // [S / 2]
    float* xs = best + S / 2;                        // [D]
    int* ks = (int*)(xs + D);                        // [D]
    unsigned char* string = (unsigned char*)(ks + D);  // [MAXB]
    trace_t* trace = (trace_t*)(string + ((MAXB + 15) / 16) * 16);  // up to D * S / 2
    __shared__ float red_cost[32];
    __shared__ int red_state[32];

    const int tid = threadIdx.x;
    const long long vec = (long long)blockIdx.x * heads + blockIdx.y;
    const int h = blockIdx.y;
    for (int i = tid; i < D; i += NTHREADS) {
        xs[i] = x[vec * D + i];
        ks[i] = bits[h * D + i];
    }
    for (int i = tid; i < MAXB; i += NTHREADS) string[i] = 0;
    for (int s = tid; s < S; s += NTHREADS) cost[s] = s == 0 ? 0.0f : __int_as_float(0x7f800000);
    __syncthreads();

    const float* head_tables = tables + (long long)h * widths * S;
    int offset = 0;
    for (int t = 0; t < D; ++t) {
        const int k = ks[t];
        if (k == 0) continue;
        const int half = S >> k, shift = L - k, fan = 1 << k;
        for (int j = tid; j < half; j += NTHREADS) {
            float m = cost[j];
            int arg = 0;
            for (int hi = 1; hi < fan; ++hi) {
                const float c = cost[j | (hi << shift)];
                if (c < m) { m = c; arg = hi; }
            }
            best[j] = m;
            trace[offset + j] = (trace_t)arg;
        }
        __syncthreads();
        const float target = xs[t];
        const float* table = head_tables + (k - 1) * S;
        for (int s = tid; s < S; s += NTHREADS) {
            const float e = target - __ldg(table + s);
            next[s] = best[s >> k] + e * e;
        }
        __syncthreads();
        float* swap = cost; cost = next; next = swap;
        offset += half;
    }

    // the cheapest final state (the lowest on ties)
    float m = __int_as_float(0x7f800000);
    int arg = 0;
    for (int s = tid; s < S; s += NTHREADS) {
        if (cost[s] < m) { m = cost[s]; arg = s; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float om = __shfl_down_sync(0xffffffffu, m, o);
        const int oa = __shfl_down_sync(0xffffffffu, arg, o);
        if (om < m || (om == m && oa < arg)) { m = om; arg = oa; }
    }
    if ((tid & 31) == 0) { red_cost[tid >> 5] = m; red_state[tid >> 5] = arg; }
    __syncthreads();

    if (tid == 0) {
        int s = red_state[0];
        m = red_cost[0];
        for (int w = 1; w < NTHREADS / 32; ++w) {
            if (red_cost[w] < m || (red_cost[w] == m && red_state[w] < s)) { m = red_cost[w]; s = red_state[w]; }
        }
        int end = 0;
        for (int t = 0; t < D; ++t) end += ks[t];
        for (int t = D - 1; t >= 0; --t) {
            const int k = ks[t];
            if (k == 0) continue;
            const int start = end - k, fresh = s & ((1 << k) - 1);
            for (int j = 0; j < k; ++j) {
                if ((fresh >> (k - 1 - j)) & 1) {
                    const int p = start + j;
                    string[p >> 3] |= (unsigned char)(0x80 >> (p & 7));
                }
            }
            offset -= S >> k;
            const int high = trace[offset + (s >> k)];
            s = (s >> k) | (high << (L - k));
            end = start;
        }
    }
    __syncthreads();
    for (int i = tid; i < nbytes; i += NTHREADS) codes[vec * nbytes + i] = string[i];
}
