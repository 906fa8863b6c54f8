// One decode step's append to a layer whose keys and values the trellis codec codes, in one
// launch: the token that leaves the full-precision window coded (its components by the codec's
// KLT in float64, then block_walk.cuh's walk, prepended by trellis_append.py), the window shift,
// the new token into its slot, the two counters. The keys' and the values' walks run side by side.
// -D defines: block_walk.cuh's (L, D, MAXK, MAXB, BT), FP16 (1: windows float16; 0: bfloat16).
//
// Semantics: append_through_window (ops/append.py) for one new token, its key already K~ in the
// window dtype. Per (batch row, KV head), with c = n_coded, w = n_window, R the window's slots:
//   w < R:   window slot w <- the new token; n_window = w + 1
//   w == R:  codes at slot c <- the walk of window slot 0 (not written when c >= Tmax); slots
//            1..R-1 move to 0..R-2; slot R-1 <- the new token; n_coded = c + 1
//            (R == 0: codes at slot c <- the walk of the new token)
// A token's components: ((x - center) @ analysis) * inverse_sd in float64, rounded to float32,
// as codecs/trellis/code.components computes them.
//
// grid (B * H, 2): blockIdx.y 0 codes the keys, 1 the values; a CTA owns its side of one row: the
// walk, the code write, the window shift. Only the counters are shared: every CTA reads them
// first, and the CTA that arrives last on `arrivals` (zero between launches: that CTA resets it)
// writes them. The leaving token and the shift's first pass are loaded at the start.

#define PARTS (BT >= D ? BT / D : 1)  // threads summing one component of the KLT
#define PIECES (D / 8)                 // 16-byte pieces of a window row
#define SHIFT_PER 2                    // pieces a thread moves a pass

struct __align__(16) w4 { unsigned x, y, z, w; };

extern "C" __global__ void __launch_bounds__(BT) trellis_append(
    const u16* __restrict__ knew,          // [B * H, D] the new token's K~, window dtype
    const u16* __restrict__ vnew,          // [B * H, D] its value
    unsigned char* __restrict__ k_codes,   // [B * H, Tmax, kbytes]
    unsigned char* __restrict__ v_codes,   // [B * H, Tmax, vbytes]
    u16* __restrict__ k_window,            // [B * H, R, D]
    u16* __restrict__ v_window,            // [B * H, R, D]
    long long* n_coded, long long* n_window, int* arrivals,
    const double* __restrict__ k_center,      // [H, D]
    const double* __restrict__ k_analysis,    // [H, D, D]
    const double* __restrict__ k_inverse_sd,  // [H, D]
    const int* __restrict__ k_bits,           // [H, D]
    const float* __restrict__ k_tables,       // [H, kwidths, S]
    const double* __restrict__ v_center, const double* __restrict__ v_analysis,
    const double* __restrict__ v_inverse_sd, const int* __restrict__ v_bits, const float* __restrict__ v_tables,
    int H, int Tmax, int R, int kbytes, int vbytes, int kwidths, int vwidths) {
    extern __shared__ __align__(16) unsigned char walk_smem[];  // WALK_SMEM_BYTES
    __shared__ float xs[D];                // the leaving token's components
    __shared__ int ks[D];                  // bits a component
    __shared__ double centered[D];         // the leaving token minus the center
    __shared__ double partial[PARTS][D];   // the KLT's per-part sums

    const int row = blockIdx.x, h = row % H, tid = threadIdx.x;
    const bool is_value = blockIdx.y == 1;
    const u16* fresh = (is_value ? vnew : knew) + (size_t)row * D;
    u16* win = (is_value ? v_window : k_window) + (size_t)row * R * D;
    const double* center = (is_value ? v_center : k_center) + h * D;
    const double* analysis = (is_value ? v_analysis : k_analysis) + (size_t)h * D * D;
    const double* inverse_sd = (is_value ? v_inverse_sd : k_inverse_sd) + h * D;
    const int* bits = (is_value ? v_bits : k_bits) + h * D;
    const int widths = is_value ? vwidths : kwidths;
    const float* tables = (is_value ? v_tables : k_tables) + (size_t)h * widths * S;
    const int nbytes = is_value ? vbytes : kbytes;

    // 0. the counters, the leaving token (window slot 0, or the new token without a window) and the
    // shift's first pass (rows 1..R-1 are one run of (R - 1) * PIECES pieces)
    const long long c = *n_coded, w = *n_window;
    const bool flush = w >= R;  // uniform: its oldest token leaves
    const int items = R > 1 ? (R - 1) * PIECES : 0;
    w4 moving[SHIFT_PER];
    if (flush) {
        for (int i = tid; i < D; i += BT) {
            centered[i] = (double)half_bits_to_float(R > 0 ? win[i] : fresh[i], FP16) - center[i];
            ks[i] = bits[i];
        }
#pragma unroll
        for (int u = 0; u < SHIFT_PER; ++u) {
            const int it = u * BT + tid;
            if (it < items) moving[u] = ((const w4*)(win + D))[it];
        }
    }
    __syncthreads();

    if (flush) {
        // 1. the shift: piece it of rows 1.. moves one row up; a pass loads all its pieces before
        // any is stored (its targets overlap its sources), and a later pass's sources lie past
        // every earlier target
#pragma unroll
        for (int u = 0; u < SHIFT_PER; ++u) {
            const int it = u * BT + tid;
            if (it < items) ((w4*)win)[it] = moving[u];
        }
        for (int base = SHIFT_PER * BT; base < items; base += SHIFT_PER * BT) {
#pragma unroll
            for (int u = 0; u < SHIFT_PER; ++u) {
                const int it = base + u * BT + tid;
                if (it < items) moving[u] = ((const w4*)(win + D))[it];
            }
            __syncthreads();
#pragma unroll
            for (int u = 0; u < SHIFT_PER; ++u) {
                const int it = base + u * BT + tid;
                if (it < items) ((w4*)win)[it] = moving[u];
            }
        }

        // 2. the components: column col of the KLT, summed over PARTS interleaved parts
        for (int o = tid; o < PARTS * D; o += BT) {
            const int col = o % D, part = o / D;
            double acc = 0.0;
            for (int d = part; d < D; d += PARTS) acc = fma(centered[d], analysis[(size_t)d * D + col], acc);
            partial[part][col] = acc;
        }
        __syncthreads();
        for (int i = tid; i < D; i += BT) {
            double sum = partial[0][i];
#pragma unroll
            for (int p = 1; p < PARTS; ++p) sum += partial[p][i];
            xs[i] = (float)(sum * inverse_sd[i]);
        }

        // 3. the walk (its first barrier orders xs before the steps; it ends on a barrier, after
        // every load of the shift) and the code write
        block_walk(xs, ks, tables, walk_smem);
        if (c < Tmax) {
            const unsigned char* bytes = (const unsigned char*)walk_string(walk_smem);
            unsigned char* out = (is_value ? v_codes : k_codes) + ((size_t)row * Tmax + c) * nbytes;
            for (int i = tid; i < nbytes; i += BT) out[i] = bytes[i];
        }
    }

    // 4. the new token into its slot
    if (R > 0) {
        const int slot = flush ? R - 1 : (int)w;
        for (int i = tid; i < D; i += BT) win[(size_t)slot * D + i] = fresh[i];
    }

    // 5. the counters, by the last CTA to arrive (every CTA has read them by then)
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
