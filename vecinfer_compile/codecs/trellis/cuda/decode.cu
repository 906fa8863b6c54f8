// Decode attention over trellis codes (vecinfer_compile/codecs/trellis/operands.py): one query token per query
// head against a layer's coded prefix, in the components, with the codec's tables in shared memory.
// Same partial outputs as the Triton kernel (codecs/trellis/triton_kernels.py): acc [B*Hkv, splits*VG, BG, D],
// m and l [B*Hkv, splits*VG, BG] (log2 units), merged by ops/split_attention/lse_merge.py.
// Compiled at run time with NVRTC (trellis_decode.py); no toolkit headers.
//
// Defines: D (head_dim, a multiple of 4), G (query heads a KV head), BG (the outputs' padded G), L
// (state bits, <= 16), WK, WV (table widths), NBK, NBV (bytes of a key / value code row, multiples
// of 4), NTHREADS (= TILE, tokens a tile, and threads a CTA; a multiple of 32).
//
// grid (B * Hkv, splits). A tile of TILE tokens: the code rows go to shared memory as big-endian
// words (bit 0 of a row's string the top bit of word 0; a row's stride an odd number of words, so
// that a thread per token reads its own row without bank conflicts), the next tile's rows already
// loading into registers. Scores: a thread a token, reading its row's string front to back through
// a 64-bit window that slides a word at a time (where each component's state ends in it, and when
// it slides, are the per-component parameters kpar); the tile's max and sum per query head by warp
// shuffles. Values: a thread a component (VG groups of D threads, each group every VG-th token of
// the tile), each state read from the two words that hold it. Group v > 0 writes its partial sums as
// a split of its own with l = 0 and the shared m, so the merge adds the groups like any splits.

#define S (1 << L)
#define SMASK (S - 1)
#define NWK (NBK / 4)                        // words of a key / value row
#define NWV (NBV / 4)
#define RWK ((NWK + 1) | 1)                  // words a row takes in shared memory: odd, at least one of zeros
#define RWV ((NWV + 1) | 1)
#define TILE NTHREADS
#define NWARPS (NTHREADS / 32)
#define VG (NTHREADS >= D ? NTHREADS / D : 1)    // token groups of the value phase
#define CPT ((D + NTHREADS - 1) / NTHREADS)      // components a value-phase thread owns
#define NEG_INF (-__int_as_float(0x7f800000))
#define ADVANCE 128                          // kpar: slide the window by a word before this component

__device__ __forceinline__ unsigned big_endian(unsigned w) { return __byte_perm(w, 0u, 0x0123); }

__device__ __forceinline__ unsigned state_at(unsigned hi, unsigned lo, int shift) {
    // the L bits of the 64-bit string hi:lo that end `shift` bits above its bottom (shift in [0, 64))
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> shift) & SMASK;
}

__device__ __forceinline__ int string_end(const int* first, const int* shift, int i) {
    // where component i's new bits end in the string (codecs/trellis/packing.state_windows)
    return 8 * first[i] + 24 - shift[i];
}

__device__ __forceinline__ int window_base(int end) {
    // the first bit of the 64-bit window the scores read component `end`'s state from: the least
    // multiple of 32 with end <= base + 64 (so end - base > 32 >= L once the window has slid)
    return end > 64 ? (end - 33) / 32 * 32 : 0;
}

// acc[g] += w[g] * e over G query heads, w read from shared memory (16-byte vectors where G allows)
__device__ __forceinline__ void fma_heads(float* acc, const float* w, float e) {
#if G % 4 == 0
#pragma unroll
    for (int g = 0; g < G; g += 4) {
        const float4 x = *(const float4*)(w + g);
        acc[g] = fmaf(x.x, e, acc[g]);
        acc[g + 1] = fmaf(x.y, e, acc[g + 1]);
        acc[g + 2] = fmaf(x.z, e, acc[g + 2]);
        acc[g + 3] = fmaf(x.w, e, acc[g + 3]);
    }
#else
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = fmaf(w[g], e, acc[g]);
#endif
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
    float* q = vtab + WV * S;                            // [D, G]: a component's G query entries together
    float* p = q + D * G;                                // [TILE, G]
    float* red_max = p + TILE * G;                       // [NWARPS, G]
    float* red_sum = red_max + NWARPS * G;               // [NWARPS, G]
    int* kpar = (int*)(red_sum + NWARPS * G);            // [D]: shift | ADVANCE | table offset << 8; -1: 0 bits
    unsigned* krow = (unsigned*)(kpar + D);              // [TILE, RWK]
    unsigned* vrow = krow + TILE * RWK;                  // [TILE, RWV]

    const int tid = threadIdx.x, bh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int b = bh / hkv, h = bh - b * hkv;
    const int warp = tid >> 5, lane = tid & 31;
    for (int i = tid; i < WK * S; i += NTHREADS) ktab[i] = ktables[(long long)h * WK * S + i];
    for (int i = tid; i < WV * S; i += NTHREADS) vtab[i] = vtables[(long long)h * WV * S + i];
    for (int i = tid; i < G * D; i += NTHREADS) q[(i % D) * G + i / D] = qc[(long long)bh * G * D + i];
    const int* kf = kfirst + h * D;
    const int* ks = kshift + h * D;
    for (int c = tid; c < D; c += NTHREADS) {
        const int end = string_end(kf, ks, c);
        const int slides = window_base(end) != window_base(c > 0 ? string_end(kf, ks, c - 1) : 0);
        kpar[c] = kmask[h * D + c] == 0 ? -1
                : (64 - (end - window_base(end))) | (slides ? ADVANCE : 0) | ((krows[h * D + c] - h * WK * S) << 8);
    }
    // the value phase: this thread's group and components, each state's word and shift in its row
    const int vgrp = VG > 1 ? tid / D : 0;
    const int vc0 = VG > 1 ? tid - vgrp * D : tid;
    const bool vactive = vgrp < VG;
    int vw[CPT], vsh[CPT], vtb[CPT];
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const int c = vc0 + j * NTHREADS;
        const bool own = vactive && c < D && vmask[h * D + min(c, D - 1)] != 0;
        const int end = own ? string_end(vfirst + h * D, vshift + h * D, c) : 0;
        const int first_bit = max(end - L, 0);
        vw[j] = first_bit / 32;
        vsh[j] = 64 - (end - 32 * vw[j]);
        vtb[j] = own ? vrows[h * D + c] - h * WV * S : -1;
    }
    for (int i = tid; i < TILE; i += NTHREADS) {  // the rows' padding words, never written again
        for (int w = NWK; w < RWK; ++w) krow[i * RWK + w] = 0u;
        for (int w = NWV; w < RWV; ++w) vrow[i * RWV + w] = 0u;
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
        m_i[g] = NEG_INF;
        l_i[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < CPT; ++j) acc[g][j] = 0.0f;
    }

    // this thread's words of a tile's rows (word i = tid + j * NTHREADS of the tile's TILE * NW),
    // loaded a tile ahead; tokens past hi read as zeros
    const unsigned char* kbase = k_codes + (long long)b * s_kb + (long long)h * s_kh;
    const unsigned char* vbase = v_codes + (long long)b * s_vb + (long long)h * s_vh;
    unsigned kpre[NWK], vpre[NWV];
    auto fetch = [&](int t0) {
#pragma unroll
        for (int j = 0; j < NWK; ++j) {
            const int i = tid + j * NTHREADS, r = i / NWK, t = t0 + r;
            kpre[j] = t < hi ? ((const unsigned*)(kbase + (long long)t * s_kt))[i - r * NWK] : 0u;
        }
#pragma unroll
        for (int j = 0; j < NWV; ++j) {
            const int i = tid + j * NTHREADS, r = i / NWV, t = t0 + r;
            vpre[j] = t < hi ? ((const unsigned*)(vbase + (long long)t * s_vt))[i - r * NWV] : 0u;
        }
    };
    if (lo < hi) fetch(lo);
    __syncthreads();

    for (int t0 = lo; t0 < hi; t0 += TILE) {
#pragma unroll
        for (int j = 0; j < NWK; ++j) {
            const int i = tid + j * NTHREADS, r = i / NWK;
            krow[r * RWK + i - r * NWK] = big_endian(kpre[j]);
        }
#pragma unroll
        for (int j = 0; j < NWV; ++j) {
            const int i = tid + j * NTHREADS, r = i / NWV;
            vrow[r * RWV + i - r * NWV] = big_endian(vpre[j]);
        }
        __syncthreads();
        if (t0 + TILE < hi) fetch(t0 + TILE);
        // scores: a thread a token, its row's string front to back
        float s[G];
        {
#pragma unroll
            for (int g = 0; g < G; ++g) s[g] = 0.0f;
            const unsigned* kr = krow + tid * RWK;
            unsigned whi = kr[0], wlo = kr[1];
            int next = 2;
            for (int c = 0; c < D; ++c) {
                const int prm = kpar[c];
                if (prm < 0) continue;  // a component of 0 bits (uniform across the CTA)
                if (prm & ADVANCE) { whi = wlo; wlo = kr[next++]; }
                const float e = ktab[(prm >> 8) + state_at(whi, wlo, prm & 127)];
                fma_heads(s, q + c * G, e);
            }
            const bool valid = t0 + tid < hi;
#pragma unroll
            for (int g = 0; g < G; ++g) s[g] = valid ? (s[g] + bias_g[g]) * scale2 : NEG_INF;
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = s[g];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            if (lane == 0) red_max[warp * G + g] = mx;
        }
        __syncthreads();
        float alpha[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = red_max[g];
#pragma unroll
            for (int w = 1; w < NWARPS; ++w) mx = fmaxf(mx, red_max[w * G + g]);
            const float m_new = fmaxf(m_i[g], mx);
            const float m_safe = m_new == NEG_INF ? 0.0f : m_new;
            alpha[g] = exp2f(m_i[g] - m_safe);
            m_i[g] = m_new;
            s[g] = exp2f(s[g] - m_safe);
            p[tid * G + g] = s[g];
            float sum = s[g];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) red_sum[warp * G + g] = sum;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) sum += red_sum[w * G + g];
            l_i[g] = l_i[g] * alpha[g] + sum;
#pragma unroll
            for (int j = 0; j < CPT; ++j) acc[g][j] *= alpha[g];
        }
        // values: a thread a component, over its group's tokens of the tile
        const int count = min(TILE, hi - t0);
        for (int i = vgrp; i < count; i += VG) {
            const unsigned* vr = vrow + i * RWV;
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                if (vtb[j] < 0) continue;
                const float e = vtab[vtb[j] + state_at(vr[vw[j]], vr[vw[j] + 1], vsh[j])];
                float a[G];
#pragma unroll
                for (int g = 0; g < G; ++g) a[g] = acc[g][j];
                fma_heads(a, p + i * G, e);
#pragma unroll
                for (int g = 0; g < G; ++g) acc[g][j] = a[g];
            }
        }
        __syncthreads();  // the tile's rows, p and the reductions are replaced next
    }
    if (!vactive) return;
    const long long out = ((long long)bh * splits * VG + split * VG + vgrp) * BG;
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        const int c = vc0 + j * NTHREADS;
        if (c < D) {
#pragma unroll
            for (int g = 0; g < G; ++g) acc_out[(out + g) * D + c] = acc[g][j];
        }
    }
    if (vc0 == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) { m_out[out + g] = m_i[g]; l_out[out + g] = vgrp == 0 ? l_i[g] : 0.0f; }
    }
}
