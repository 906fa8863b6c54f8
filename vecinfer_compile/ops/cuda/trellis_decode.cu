// Decode attention over trellis codes (vecinfer_compile/ops/trellis.py): one query token per query
// head against a layer's coded prefix, in the components, with the codec's tables in shared memory.
// Same partial outputs as the Triton kernel (ops/triton/trellis.py): acc [B*Hkv, splits, BG, D],
// m and l [B*Hkv, splits, BG] (log2 units), merged by ops/split_attention/lse_merge.py.
// Compiled at run time with NVRTC (trellis_decode.py); no toolkit headers.
//
// Defines: D (head_dim), G (query heads a KV head), BG (the outputs' padded G), L (state bits),
// WK, WV (table widths), NBK, NBV (bytes of a key / value code row, multiples of 4), NTHREADS
// (= TILE, tokens a tile, and threads a CTA; a multiple of 32).
//
// grid (B * Hkv, splits). A tile of TILE tokens: the code rows go to shared memory (row stride an
// odd number of words, so that a thread per token reads its own row without bank conflicts);
// scores with a thread per token over every component (the query in shared memory, read as
// broadcasts); the tile's max and sum per query head; then the values with a thread per component
// over the tile's tokens (p read as broadcasts), the accumulators in registers.

#define S (1 << L)
#define RWK ((NBK / 4 + 1) | 1)   // words a key row takes in shared memory: odd, at least one of zeros
#define RWV ((NBV / 4 + 1) | 1)      // (NBK, NBV multiples of 4; a window reads up to 2 bytes past a row)
#define TILE NTHREADS
#define CPT ((D + NTHREADS - 1) / NTHREADS)   // components a thread owns in the value phase

__device__ __forceinline__ unsigned window24(const unsigned* row, int first) {
    // bytes first, first+1, first+2 of a row (stored as little-endian words) as (b0 << 16 | b1 << 8 | b2)
    const unsigned char* bytes = (const unsigned char*)row;
    return ((unsigned)bytes[first] << 16) | ((unsigned)bytes[first + 1] << 8) | (unsigned)bytes[first + 2];
}

extern "C" __global__ void __launch_bounds__(NTHREADS)
trellis_decode(const float* __restrict__ qc, const float* __restrict__ bias,
               const unsigned char* __restrict__ k_codes, const unsigned char* __restrict__ v_codes,
               const int* __restrict__ kfirst, const int* __restrict__ kshift, const int* __restrict__ kmask,
               const int* __restrict__ krows, const float* __restrict__ ktables,
               const int* __restrict__ vfirst, const int* __restrict__ vshift, const int* __restrict__ vmask,
               const int* __restrict__ vrows, const float* __restrict__ vtables,
               const int* __restrict__ start, const long long* __restrict__ n_ptr,
               float* __restrict__ acc_out, float* __restrict__ m_out, float* __restrict__ l_out,
               int n_coded, int hkv, int split_len, float scale2,
               int s_kb, int s_kh, int s_kt, int s_vb, int s_vh, int s_vt) {  // byte strides (the launcher's ints)
    extern __shared__ __align__(16) unsigned char smem[];
    float* ktab = (float*)smem;                          // [WK * S]
    float* vtab = ktab + WK * S;                         // [WV * S]
    float* q = vtab + WV * S;                            // [G, D]
    float* p = q + G * D;                                // [G, TILE]
    float* stat = p + G * TILE;                          // [2, G]: the tile's max, then sum
    int* kpar = (int*)(stat + 2 * G);                    // [4, D]: first, shift, mask, row of each key component
    unsigned* krow = (unsigned*)(kpar + 4 * D);          // [TILE, RWK]
    unsigned* vrow = krow + TILE * RWK;                  // [TILE, RWV]

    const int tid = threadIdx.x, bh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int b = bh / hkv, h = bh - b * hkv;
    for (int i = tid; i < WK * S; i += NTHREADS) ktab[i] = ktables[(long long)h * WK * S + i];
    for (int i = tid; i < WV * S; i += NTHREADS) vtab[i] = vtables[(long long)h * WV * S + i];
    for (int i = tid; i < G * D; i += NTHREADS) q[i] = qc[(long long)bh * G * D + i];
    for (int c = tid; c < D; c += NTHREADS) {
        kpar[c] = kfirst[h * D + c];
        kpar[D + c] = kshift[h * D + c];
        kpar[2 * D + c] = kmask[h * D + c];
        kpar[3 * D + c] = krows[h * D + c] - h * WK * S;
    }
    int vf[CPT], vs[CPT], vm[CPT], vr[CPT];
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const int c = tid + j * NTHREADS;
        const bool own = c < D;
        vf[j] = own ? vfirst[h * D + c] : 0;
        vs[j] = own ? vshift[h * D + c] : 0;
        vm[j] = own ? vmask[h * D + c] : 0;
        vr[j] = own ? vrows[h * D + c] - h * WV * S : 0;
    }
    for (int i = tid; i < TILE; i += NTHREADS) {  // the rows' padding words, never written again
        for (int w = NBK / 4; w < RWK; ++w) krow[i * RWK + w] = 0u;
        for (int w = NBV / 4; w < RWV; ++w) vrow[i * RWV + w] = 0u;
    }
    float bias_g[G];
#pragma unroll
    for (int g = 0; g < G; ++g) bias_g[g] = bias[(long long)bh * G + g];
    const int n = n_ptr ? (int)*n_ptr : n_coded;
    int lo = split * split_len;
    const int hi = min(lo + split_len, n);
    if (start) lo = max(lo, start[b]);

    float m_i[G], l_i[G], acc[G][CPT];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m_i[g] = -__int_as_float(0x7f800000);
        l_i[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < CPT; ++j) acc[g][j] = 0.0f;
    }
    __syncthreads();

    const unsigned char* krows_g = k_codes + (long long)b * s_kb + (long long)h * s_kh;
    const unsigned char* vrows_g = v_codes + (long long)b * s_vb + (long long)h * s_vh;
    for (int t0 = lo; t0 < hi; t0 += TILE) {
        // the tile's code rows, word by word (coalesced); tokens past hi read as zeros
        for (int i = tid; i < TILE * (NBK / 4); i += NTHREADS) {
            const int r = i / (NBK / 4), w = i - r * (NBK / 4), t = t0 + r;
            krow[r * RWK + w] = t < hi ? ((const unsigned*)(krows_g + (long long)t * s_kt))[w] : 0u;
        }
        for (int i = tid; i < TILE * (NBV / 4); i += NTHREADS) {
            const int r = i / (NBV / 4), w = i - r * (NBV / 4), t = t0 + r;
            vrow[r * RWV + w] = t < hi ? ((const unsigned*)(vrows_g + (long long)t * s_vt))[w] : 0u;
        }
        __syncthreads();
        // scores: a thread a token, over every key component
        {
            const int t = t0 + tid;
            float s[G];
#pragma unroll
            for (int g = 0; g < G; ++g) s[g] = 0.0f;
            const unsigned* kr = krow + tid * RWK;
            for (int c = 0; c < D; ++c) {
                const int mask = kpar[2 * D + c];
                if (mask == 0) continue;  // a component of 0 bits (uniform across the CTA)
                const unsigned state = (window24(kr, kpar[c]) >> kpar[D + c]) & (unsigned)mask;
                const float e = ktab[kpar[3 * D + c] + state];
#pragma unroll
                for (int g = 0; g < G; ++g) s[g] = fmaf(q[g * D + c], e, s[g]);
            }
            const bool valid = t < hi;
#pragma unroll
            for (int g = 0; g < G; ++g) p[g * TILE + tid] = valid ? (s[g] + bias_g[g]) * scale2 : -__int_as_float(0x7f800000);
        }
        __syncthreads();
        // the tile's max per query head (warp g % warps reduces head g), then p = exp2(s - m_new)
        const int warp = tid >> 5, lane = tid & 31;
        for (int g = warp; g < G; g += NTHREADS / 32) {
            float mx = -__int_as_float(0x7f800000);
            for (int i = lane; i < TILE; i += 32) mx = fmaxf(mx, p[g * TILE + i]);
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            if (lane == 0) stat[g] = mx;
        }
        __syncthreads();
        float alpha[G], m_safe[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m_new = fmaxf(m_i[g], stat[g]);
            m_safe[g] = m_new == -__int_as_float(0x7f800000) ? 0.0f : m_new;
            alpha[g] = exp2f(m_i[g] - m_safe[g]);
            m_i[g] = m_new;
        }
        __syncthreads();  // every thread has read stat before it is reused for the sums
#pragma unroll
        for (int g = 0; g < G; ++g) p[g * TILE + tid] = exp2f(p[g * TILE + tid] - m_safe[g]);
        __syncthreads();
        for (int g = warp; g < G; g += NTHREADS / 32) {
            float sum = 0.0f;
            for (int i = lane; i < TILE; i += 32) sum += p[g * TILE + i];
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) stat[G + g] = sum;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < G; ++g) l_i[g] = l_i[g] * alpha[g] + stat[G + g];
        // values: a thread a component, over the tile's tokens
#pragma unroll
        for (int j = 0; j < CPT; ++j) {
#pragma unroll
            for (int g = 0; g < G; ++g) acc[g][j] *= alpha[g];
            if (vm[j] == 0) continue;
            const int count = min(TILE, hi - t0);
            for (int i = 0; i < count; ++i) {
                const unsigned state = (window24(vrow + i * RWV, vf[j]) >> vs[j]) & (unsigned)vm[j];
                const float e = vtab[vr[j] + state];
#pragma unroll
                for (int g = 0; g < G; ++g) acc[g][j] = fmaf(p[g * TILE + i], e, acc[g][j]);
            }
        }
        __syncthreads();  // the tile's rows and p are replaced next
    }
    const long long out = ((long long)bh * splits + split) * BG;
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const int c = tid + j * NTHREADS;
        if (c < D) {
#pragma unroll
            for (int g = 0; g < G; ++g) acc_out[(out + g) * D + c] = acc[g][j];
        }
    }
    if (tid == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) { m_out[out + g] = m_i[g]; l_out[out + g] = l_i[g]; }
    }
}
