// Decode attention over VQ codes: flash-decoding with the codebooks in shared memory.
//
// Compiled at run time with NVRTC (see decode.py); no toolkit headers. Compile-time
// parameters arrive as -D defines:
//   D            head_dim (64 or 128)             G        query heads per KV head (1..16)
//   DK, DV       channels per key / value centroid (2, 4 or 8)
//   EK, EV       key / value codebook entries     KFMT, VFMT  code format: 0 one byte per code
//                                                 (EK/EV <= 256), 2 packed 12-bit (see row_bytes)
//   KCOPIES, VCOPIES  codebook copies in shared memory (lane l reads copy l % COPIES)
//   INTERLEAVE   1: both books have <= 256 entries, each entry's copies 128 bytes; entry e's key
//                copies and value copies share one 256-byte row of a 64 KiB-aligned region, so
//                that a gather's shared address is one byte permute of its code word (see
//                gather_address); 0: each book on its own, entry e at e * COPIES * DIM * 2
//   FP16         1: q, windows, output and the tensor-core operands are float16; 0: bfloat16
//   NWARPS       warps per CTA of the split kernel
//   MINB         CTAs per SM the split kernel's register budget is sized for
//   VPAIR        1 (G <= 4): the value product pairs channels instead of positions (see
//                block_step): its A fragments are the gathered centroid words as they land
//   KBYTE, VBYTE 1 (single-copy books of 4 or 8 dims): the key / value book holds each centroid as bytes
//                u = k + 64 of a 7-bit k in [-64, 63] with one power-of-two step per book
//                (centroid = k * step, see quant/byte_centroids.py), widened after the gather
//                (widen)
//   QSMEM        1 (the lean build): the query fragments, the same in every warp of a CTA, sit in shared memory
//                after the books (NH x KSTEPS x 32 x 8 bytes) and each score k-step loads its pair, instead of 16
//                registers a thread held through the loop (see QueryFrags)
//   STAGGER      1 (the lean build): one block of codes in registers, not two: each m-tile's codes are replaced
//                by the next block's as soon as their centroids are gathered (see CodebookRows), with
//                loads the compiler may not move ahead of the gathers (asm volatile), so the next
//                block's codes are in flight for a block, as before, with half the registers
//   CLUSTER      1: the splits CTAs of a (batch row, KV head) are one thread-block cluster (sm_90)
//                and merge through distributed shared memory (see the end of this header);
//                MAX_CLUSTER, the largest cluster the launch makes
// The codebooks arrive as 16-bit centroids in the query's dtype, or (KBYTE, VBYTE) as bytes followed
// by the book's float32 step (decode.py prepares them once from the float32 ones).
//
// vq_decode: grid (B * Hkv, splits), NWARPS warps; one launch per call. Each warp is one "unit"
// of the flash-decoding split: the row's positions, in blocks of BLOCK_T, are the coded ones
// (0 .. n_coded) followed by the full-precision window's (slots 0 .. n_window), and unit u takes
// a contiguous run of those blocks (computed on the device from n_coded and n_window, so the
// launch does not depend on the cache length) and computes its partial (max, sum, unnormalised
// accumulator) for the G query heads of its KV head: coded blocks gathered from the codebooks,
// window blocks loaded from the K~ / V rows, through the same block step.
// Scores and the value accumulation run on the tensor cores (mma.sync m16n8k16, fp32
// accumulators) in transposed form, so that the few query heads of a GQA group (G <= 8 per
// n-tile of 8, G <= 16 in all) are the narrow N dimension: S^T = K Q^T (M = 16 positions) and
// O^T = V^T P^T (M = 16 channels). Each thread gathers its A fragments straight from the
// shared-memory codebook with one 4/8/16-byte load per centroid; the contraction dimension is
// permuted so that a centroid's consecutive channels land in one fragment register pair (the
// query fragment uses the same permutation, so the products are unchanged; a window row's
// channels are already in that order). P^T reaches the value product's B fragment through four
// warp shuffles per 16 positions.
// Each CTA merges its warps' partials in shared memory and writes one partial; the CTA that
// arrives last for its (batch row, KV head) (a per-row arrival counter, zero at the launch, which
// that CTA zeroes again for the next launch; one release/acquire atomic per CTA) merges the
// splits partials by log-sum-exp, normalises and writes the output. Fully masked rows give
// zeros. With CLUSTER, the launch makes each row's splits CTAs one cluster instead: every CTA
// keeps its partial in its own shared memory, and after a cluster barrier each CTA merges a share
// of the row's outputs from all of them (distributed shared memory): no partial goes through
// global memory, no counter, and no CTA waits for a last one to arrive.

#ifndef CLUSTER
#define CLUSTER 0
#endif
#ifndef INTERLEAVE
#define INTERLEAVE 0
#endif
#ifndef VPAIR
#define VPAIR 0
#endif
#ifndef KBYTE
#define KBYTE 0
#endif
#ifndef VBYTE
#define VBYTE 0
#endif
#ifndef QSMEM
#define QSMEM 0
#endif
#ifndef STAGGER
#define STAGGER 0
#endif
#define RESCALE_SLACK 8.0f  // how far (log2 units) a score may pass the running max before it moves
#define BLOCK_T 64              // positions per warp iteration
#define NT (BLOCK_T / 8)        // score n-tiles per iteration
#define KSTEPS (D / 16)         // k-steps of the score product
#define SLICE_K (D / 4)         // key channels a thread gathers per position
#define NCODE_K (SLICE_K / DK)  // key codes a thread reads per position
#define SK (D / DK)              // key codes per position (sub-vectors)
#define SLICE_V (D / 8)         // value channels a thread gathers per position (= value n-tiles)
#define NCODE_V (SLICE_V / DV)
#define SV (D / DV)
#define KWORDS (code_words(NCODE_K, KFMT))
#define VWORDS (code_words(NCODE_V, VFMT))
#define KROW_BYTES (row_bytes(SK, KFMT))
#define VROW_BYTES (row_bytes(SV, VFMT))
#define NEG_INF (-__int_as_float(0x7f800000))
#define KELEM (KBYTE ? 1 : 2)  // bytes a key centroid channel takes in shared memory
#define VELEM (VBYTE ? 1 : 2)  // and a value one
#if KBYTE
static_assert(KCOPIES == 1, "byte books are the single-copy (4096-entry) ones");
#endif
#if VBYTE
static_assert(VCOPIES == 1, "byte books are the single-copy (4096-entry) ones");
#endif
#if VPAIR
static_assert(G <= 4, "the paired value product holds 4 heads x 2 channels of a pair in its N = 8");
#define ACC_M (D / 32)  // value m-tiles: 16 rows of two channels each
#else
#define ACC_M (D / 16)  // value m-tiles: 16 channels
#endif

#if FP16
#define MMA_TYPE "f16"
#else
#define MMA_TYPE "bf16"
#endif

struct __align__(8) vq_w2 { unsigned x, y; };
struct __align__(16) vq_w4 { unsigned x, y, z, w; };
struct __align__(16) vq_f4 { float x, y, z, w; };

// Two floats -> one register of two 16-bit values, `lo` in the low half (round to nearest).
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
#if FP16
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int read_index(const void* p, int i, int is64) {
    return is64 ? (int)((const long long*)p)[i] : ((const int*)p)[i];
}

// Bytes of one position's codes: S codes as one byte each (FMT 0) or packed 12-bit (FMT 2): the S
// low bytes, then ceil(S / 2) bytes of high nibbles (code 2i low nibble, 2i + 1 high nibble).
__host__ __device__ constexpr int row_bytes(int s, int fmt) { return fmt == 0 ? s : s + (s + 1) / 2; }
// Registers holding a thread's n codes of one position: the low bytes in the first (n + 3) / 4
// words, packed nibbles after them.
__host__ __device__ constexpr int low_words(int n) { return (n + 3) / 4; }
__host__ __device__ constexpr int code_words(int n, int fmt) {
    return low_words(n) + (fmt == 2 ? (n / 2 + 3) / 4 + (n == 1) : 0);
}

// NB bytes of codes at p (NB in 1, 2, 4, 8, 16; p aligned to NB) into words w[].
template <int NB>
__device__ __forceinline__ void load_code_bytes(const unsigned char* p, unsigned* w) {
#if STAGGER
    if (NB == 16) {
        asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
    } else if (NB == 8) {
        asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
    } else if (NB == 4) {
        asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
    } else if (NB == 2) {
        unsigned short x;
        asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(x) : "l"(p));
        w[0] = x;
    } else {
        unsigned short x;
        asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(x) : "l"(p));
        w[0] = x & 0xffu;
    }
    return;
#endif
    if (NB == 16) {
        vq_w4 v = *(const vq_w4*)p;
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if (NB == 8) {
        vq_w2 v = *(const vq_w2*)p;
        w[0] = v.x; w[1] = v.y;
    } else if (NB == 4) {
        w[0] = *(const unsigned*)p;
    } else if (NB == 2) {
        w[0] = *(const unsigned short*)p;
    } else {
        w[0] = *p;
    }
}

// Codes s0 .. s0 + N of the position whose codes start at `row` (S codes per position; s0 a
// multiple of N) into words w[]. Packed: the N low bytes, then the N / 2 nibble bytes (for N = 1
// the one nibble, shifted down so that code_at reads it at bit 0).
template <int N, int FMT, int S>
__device__ __forceinline__ void load_codes(const unsigned char* row, int s0, unsigned* w) {
    load_code_bytes<N>(row + s0, w);
    if (FMT == 2) {
        unsigned* wn = w + low_words(N);
        if (N == 1) wn[0] = (unsigned)row[S + (s0 >> 1)] >> ((s0 & 1) * 4);
        else load_code_bytes<N / 2>(row + S + (s0 >> 1), wn);
    }
}

template <int N, int FMT>
__device__ __forceinline__ void zero_codes(unsigned* w) {
#pragma unroll
    for (int i = 0; i < code_words(N, FMT); ++i) w[i] = 0u;
}

// Code j of the N loaded by load_codes.
template <int N, int FMT>
__device__ __forceinline__ unsigned code_at(const unsigned* w, int j) {
    unsigned c = (w[j >> 2] >> ((j & 3) * 8)) & 0xffu;
    if (FMT == 2) c |= ((w[low_words(N) + (j >> 3)] >> ((j & 7) * 4)) & 0xfu) << 8;
    return c;
}

// The DIM/2 words (DIM 16-bit channels) at shared-memory address `addr`.
template <int DIM>
__device__ __forceinline__ void lds(unsigned addr, unsigned* out) {
    if (DIM == 8) {
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3]) : "r"(addr));
    } else if (DIM == 4) {
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(out[0]), "=r"(out[1]) : "r"(addr));
    } else {
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(out[0]) : "r"(addr));
    }
}

// Byte books: byte u = k + 64 (k in [-64, 63]) of a centroid channel k * step, step a power of two.
// A byte permute makes the byte the mantissa of MAGIC + u (1024 + u in float16, 128 + u in
// bfloat16: both exact), and the result is (MAGIC + u - (MAGIC + 64)) * step = k * step, exactly
// the value the 16-bit book holds for that centroid. bfloat16: one fused multiply-add with
// -(MAGIC + 64) * step. float16: an add, then a multiply, because -(1024 + 64) * step leaves
// float16's range for steps above 32 (centroids above ~2000), which the 16-bit book holds.
#if FP16
#define BYTE_MAGIC 0x64646464u  // float16 1024 + u
#define MAGIC_VALUE 1024.f
#else
#define BYTE_MAGIC 0x43434343u  // bfloat16 128 + u
#define MAGIC_VALUE 128.f
#endif

struct ByteStep {
    unsigned mul, add;  // step, and -(MAGIC + 64) (float16) or -(MAGIC + 64) * step: in both halves
};

__device__ __forceinline__ ByteStep byte_step(float step) {
    const float add = -(MAGIC_VALUE + 64.f) * (FP16 ? 1.f : step);
    return ByteStep{pack2(step, step), pack2(add, add)};
}

// Two channels' MAGIC + u -> their k * step.
__device__ __forceinline__ unsigned widen2(unsigned x, ByteStep st) {
    unsigned r;
#if FP16
    asm("{ .reg .b32 k; add.rn.f16x2 k, %1, %3; mul.rn.f16x2 %0, k, %2; }" : "=r"(r) : "r"(x), "r"(st.mul), "r"(st.add));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(st.mul), "r"(st.add));
#endif
    return r;
}

// Four bytes (channels c .. c + 3) -> two words of two 16-bit channels each.
__device__ __forceinline__ void widen(unsigned x, ByteStep st, unsigned* out) {
    out[0] = widen2(__byte_perm(x, BYTE_MAGIC, 0x4140), st);
    out[1] = widen2(__byte_perm(x, BYTE_MAGIC, 0x4342), st);
}

// The DIM/2 words of a byte book's centroid at `addr`.
template <int DIM>
__device__ __forceinline__ void lds_bytes(unsigned addr, ByteStep st, unsigned* out) {
    static_assert(DIM == 4 || DIM == 8, "byte books hold 4 or 8 channels a centroid");
    if (DIM == 8) {
        unsigned x0, x1;
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(x0), "=r"(x1) : "r"(addr));
        widen(x0, st, out);
        widen(x1, st, out + 2);
    } else {
        unsigned x;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(x) : "r"(addr));
        widen(x, st, out);
    }
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-bit centroids [entries, DIM] -> book [entries][COPIES][DIM] in shared memory, by
// "tasks" of 32 entries (32 task .. 32 task + 31), one warp per task: each lane loads one centroid
// (load_task), then store k writes slots 32 k + lane of the task's 32 x COPIES (entry
// (32 k + lane) / COPIES, fetched from its lane by a shuffle), so that every store covers
// consecutive addresses (store_task). (A lane writing its own entry's COPIES slots puts all 32
// lanes of a store on the same banks: a 32-way conflict, a third of a short call; a flat
// thread-per-slot loop avoids it but reloads centroids once per slot. See
// docs/studies/decode-kernel-bounds.md.)
template <int DIM>
__device__ __forceinline__ void load_task(const unsigned short* __restrict__ cent, int entries, int task, int lane,
                                          unsigned* w) {
    const int e = task * 32 + lane;
#pragma unroll
    for (int i = 0; i < DIM / 2; ++i) w[i] = e < entries ? ((const unsigned*)cent)[e * (DIM / 2) + i] : 0u;
}

// ROW: bytes from one entry's copies to the next entry's (COPIES * DIM * 2, or 256 interleaved).
template <int DIM, int COPIES, int ROW>
__device__ __forceinline__ void store_task(const unsigned* w, unsigned short* book, int entries, int task, int lane) {
#pragma unroll
    for (int k = 0; k < COPIES; ++k) {
        const int s = 32 * k + lane, src = s / COPIES;
        unsigned x[DIM / 2];
#pragma unroll
        for (int i = 0; i < DIM / 2; ++i) x[i] = COPIES == 1 ? w[i] : __shfl_sync(0xffffffffu, w[i], src);
        if (task * 32 + src >= entries) continue;
        const int idx = task * 32 * COPIES + s;  // copy idx % COPIES of entry idx / COPIES
        unsigned char* at = (unsigned char*)book + (idx / COPIES) * ROW + (idx % COPIES) * (DIM * 2);
        if (DIM == 8) {
            vq_w4 v; v.x = x[0]; v.y = x[1]; v.z = x[2]; v.w = x[3];
            *(vq_w4*)at = v;
        } else if (DIM == 4) {
            vq_w2 v; v.x = x[0]; v.y = x[1];
            *(vq_w2*)at = v;
        } else {
            *(unsigned*)at = x[0];
        }
    }
}

// Bytes between consecutive key / value entries in shared memory.
#if INTERLEAVE
static_assert(KCOPIES * DK * 2 == 128 && VCOPIES * DV * 2 == 128 && EK <= 256 && EV <= 256,
              "interleaved books are two 128-byte halves of one 256-byte row per entry");
#define KROW_SMEM 256
#define VROW_SMEM 256
#define BOOK_REGION 65536  // bytes from the aligned start: 256 rows of 256 bytes
#else
#define KROW_SMEM (KCOPIES * DK * KELEM)
#define VROW_SMEM (VCOPIES * DV * VELEM)
#endif

// A single-copy (4096-entry) book is copied in instead (copy_books); the tasks fill the others.
#define KTASKS (KCOPIES == 1 ? 0 : (EK + 31) / 32)
#define VTASKS (VCOPIES == 1 ? 0 : (EV + 31) / 32)
#define FILL_BATCH 8  // tasks whose centroids a warp loads before it stores any
#define WMAX (DK > DV ? DK / 2 : DV / 2)

// Both codebooks: key tasks 0 .. KTASKS - 1, value tasks after them; warp w takes tasks w,
// w + NWARPS, ..., FILL_BATCH of them per round: all of a round's loads are issued before its
// stores, so a warp waits for one global round trip per round, not per task.
__device__ __forceinline__ void fill_books(const unsigned short* __restrict__ kcent, const unsigned short* __restrict__ vcent,
                                           unsigned short* kbook, unsigned short* vbook, int warp, int lane) {
    constexpr int per_warp = (KTASKS + VTASKS + NWARPS - 1) / NWARPS;
    constexpr int batch = per_warp < FILL_BATCH ? (per_warp > 0 ? per_warp : 1) : FILL_BATCH;
#pragma unroll 1
    for (int r0 = 0; r0 < per_warp; r0 += batch) {
        unsigned w[batch][WMAX];
#pragma unroll
        for (int j = 0; j < batch; ++j) {
            const int task = warp + (r0 + j) * NWARPS;
            if (task < KTASKS) load_task<DK>(kcent, EK, task, lane, w[j]);
            else if (task < KTASKS + VTASKS) load_task<DV>(vcent, EV, task - KTASKS, lane, w[j]);
        }
#pragma unroll
        for (int j = 0; j < batch; ++j) {
            const int task = warp + (r0 + j) * NWARPS;
            if (task < KTASKS) store_task<DK, KCOPIES, KROW_SMEM>(w[j], kbook, EK, task, lane);
            else if (task < KTASKS + VTASKS) store_task<DV, VCOPIES, VROW_SMEM>(w[j], vbook, EV, task - KTASKS, lane);
        }
    }
}

// Single-copy books (KCOPIES or VCOPIES 1: the 4096-entry ones, 32-64 KiB each) have the same
// layout in shared memory as in global memory, so they are copied with cp.async, issued at the
// kernel's start (every 16-byte piece in flight at once, no registers held) and awaited before the
// fill's barrier. (A fill of float32 centroids converted in registers was over half of a short
// 3-bit call; see docs/studies/large-codebook-formats.md.)
#define KCOPIED (KCOPIES == 1 ? EK * DK * KELEM : 0)  // bytes
#define VCOPIED (VCOPIES == 1 ? EV * DV * VELEM : 0)

__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}

__device__ __forceinline__ void copy_books(const unsigned short* __restrict__ kcent, const unsigned short* __restrict__ vcent,
                                           unsigned short* kbook, unsigned short* vbook) {
    const unsigned ka = shared_address(kbook), va = shared_address(vbook);
    const unsigned char* kc = (const unsigned char*)kcent;
    const unsigned char* vc = (const unsigned char*)vcent;
    for (int f = 16 * (int)threadIdx.x; f < KCOPIED + VCOPIED; f += 16 * NWARPS * 32)
        cp_async16(f < KCOPIED ? ka + f : va + (f - KCOPIED), f < KCOPIED ? kc + f : vc + (f - KCOPIED));
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// The position (from the block's start) of value slot r (0..3) of m-tile i of thread tig: the
// value product's k-step pairs positions 2 tig, 2 tig + 1 (and + 8) in one fragment word; VPAIR's
// sub-step r >> 1 reads positions 4 (r >> 1) + tig and + 8 (see block_step).
__device__ __forceinline__ int value_slot(int i, int r, int tig) {
#if VPAIR
    return 16 * i + 4 * (r >> 1) + tig + 8 * (r & 1);
#else
    return 16 * i + 2 * tig + (r & 1) + 8 * (r >> 1);
#endif
}

// Codes of the block at t0, loaded into registers (zeros for positions >= hi unless FULL). Key
// n-tile nt: position t0 + 8 nt + gid, this thread's SLICE_K channels. Value m-tile i, slot r:
// position t0 + value_slot(i, r, tig), this thread's SLICE_V channels.
struct BlockCodes {
    unsigned k[NT][KWORDS];
    unsigned v[4][4][VWORDS];
};

// Key codes of n-tile nt of the block at t0 (the score product's m-tile nt / 2).
__device__ __forceinline__ void load_key_tile(BlockCodes& bc, int nt, int t0, int hi, const unsigned char* kc, int gid,
                                              int tig) {
    const int t = t0 + 8 * nt + gid;
    if (t < hi) load_codes<NCODE_K, KFMT, SK>(kc + (long long)t * KROW_BYTES, tig * NCODE_K, bc.k[nt]);
    else zero_codes<NCODE_K, KFMT>(bc.k[nt]);
}

// Value codes of k-step i of the block at t0 (its four slots).
__device__ __forceinline__ void load_value_step(BlockCodes& bc, int i, int t0, int hi, const unsigned char* vc, int gid,
                                                int tig) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int t = t0 + value_slot(i, r, tig);
        if (t < hi) load_codes<NCODE_V, VFMT, SV>(vc + (long long)t * VROW_BYTES, gid * NCODE_V, bc.v[i][r]);
        else zero_codes<NCODE_V, VFMT>(bc.v[i][r]);
    }
}

__device__ __forceinline__ void load_block(BlockCodes& bc, int t0, int hi, const unsigned char* kc,
                                           const unsigned char* vc, int gid, int tig) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) load_key_tile(bc, nt, t0, hi, kc, gid, tig);
#pragma unroll
    for (int i = 0; i < 4; ++i) load_value_step(bc, i, t0, hi, vc, gid, tig);
}

#define NH ((G + 7) / 8)  // n-tiles of 8 query heads

// Attention over the block at t0 whose codes are in bc (positions >= hi masked unless FULL).
// Scores as S^T = K Q^T: M = 16 positions per m-tile, N = 8 heads per n-tile, K = channels.
// Values as O^T = V^T P^T: M = 16 channels per m-tile, N = 8 heads, K = 16 positions.
// Key and value A-fragment words of one block, gathered from the shared-memory codebooks by the
// codes in registers.
// The shared address of code j (of the N in w) in a book at `base` (this lane's copy included)
// with ROW bytes per entry. Interleaved, `base` has bits 8-15 zero (the region is 64 KiB-aligned,
// the lane's copy and the value half are under 256 bytes), so base + code * 256 is `base` with its
// byte 1 replaced by the code's byte: one byte permute instead of extract, multiply and add.
template <int N, int FMT, int ROW>
__device__ __forceinline__ unsigned gather_address(const unsigned* w, int j, unsigned base) {
#if INTERLEAVE
    return __byte_perm(w[j >> 2], base, 0x7604 | ((j & 3) << 4));
#else
    return base + code_at<N, FMT>(w, j) * ROW;
#endif
}

// REFILL (STAGGER): once an m-tile's (keys) or k-step's (values) centroids are gathered, its codes
// are replaced by those of the block at next_t0 (keys_used, values_used), so that one BlockCodes
// holds this block's codes and the next one's as they arrive.
template <bool REFILL>
struct CodebookRows {
    BlockCodes& bc;
    unsigned kbase, vbase;
    ByteStep kstep, vstep;  // KBYTE / VBYTE: the books' steps (unused otherwise)
    int next_t0, hi;        // REFILL: the next block's start and the coded positions' end
    const unsigned char* kc;
    const unsigned char* vc;
    int gid, tig;

    template <int DIM, int BYTE>
    __device__ __forceinline__ void gather(unsigned addr, ByteStep st, unsigned* out) const {
        if constexpr (BYTE) lds_bytes<DIM>(addr, st, out);
        else lds<DIM>(addr, out);
    }

    // Positions t0 + 16 mt + gid (ka) and + 8 (kb): this thread's SLICE_K channels.
    __device__ __forceinline__ void keys(int mt, unsigned* ka, unsigned* kb) const {
#pragma unroll
        for (int j = 0; j < NCODE_K; ++j) {
            gather<DK, KBYTE>(gather_address<NCODE_K, KFMT, KROW_SMEM>(bc.k[2 * mt], j, kbase), kstep, ka + j * (DK / 2));
            gather<DK, KBYTE>(gather_address<NCODE_K, KFMT, KROW_SMEM>(bc.k[2 * mt + 1], j, kbase), kstep, kb + j * (DK / 2));
        }
    }

    // Value k-step i, position r of its four (see BlockCodes): this thread's SLICE_V channels.
    __device__ __forceinline__ void values(int i, int r, unsigned* vv) const {
#pragma unroll
        for (int j = 0; j < NCODE_V; ++j)
            gather<DV, VBYTE>(gather_address<NCODE_V, VFMT, VROW_SMEM>(bc.v[i][r], j, vbase), vstep, vv + j * (DV / 2));
    }

    __device__ __forceinline__ void keys_used(int mt) const {
        if constexpr (REFILL) {
            load_key_tile(bc, 2 * mt, next_t0, hi, kc, gid, tig);
            load_key_tile(bc, 2 * mt + 1, next_t0, hi, kc, gid, tig);
        }
    }

    __device__ __forceinline__ void values_used(int i) const {
        if constexpr (REFILL) load_value_step(bc, i, next_t0, hi, vc, gid, tig);
    }
};

// 16-byte words of n 16-bit channels at p (p 16-byte aligned), or zeros when !ok.
template <int N>
__device__ __forceinline__ void load_channels(const unsigned short* p, bool ok, unsigned* w) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
        vq_w4 v = ok ? ((const vq_w4*)p)[i] : vq_w4{0u, 0u, 0u, 0u};
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
}

// The same fragment words read from full-precision rows (the window): row t of k_rows / v_rows
// is position t0 + t; rows >= n are zeros.
struct DenseRows {
    const unsigned short* k_rows;
    const unsigned short* v_rows;
    int n, gid, tig;

    __device__ __forceinline__ void keys(int mt, unsigned* ka, unsigned* kb) const {
        const int t = 16 * mt + gid;
        load_channels<SLICE_K>(k_rows + (long long)t * D + tig * SLICE_K, t < n, ka);
        load_channels<SLICE_K>(k_rows + (long long)(t + 8) * D + tig * SLICE_K, t + 8 < n, kb);
    }

    __device__ __forceinline__ void values(int i, int r, unsigned* vv) const {
        const int t = value_slot(i, r, tig);
        load_channels<SLICE_V>(v_rows + (long long)t * D + gid * SLICE_V, t < n, vv);
    }

    __device__ __forceinline__ void keys_used(int) const {}
    __device__ __forceinline__ void values_used(int) const {}
};

// The score product's B fragments (the query): thread (gid, tig) holds head 8 nh + gid, channels
// tig * SLICE_K + 4 s + {0, 1} and {2, 3} for k-step s. QSMEM: stored once per CTA in shared memory
// as [NH][KSTEPS][32 lanes] pairs of words (one 256-byte load a k-step, no bank conflict).
struct QueryFrags {
#if QSMEM
    unsigned at;  // this lane's pair of k-step 0 of n-tile 0
    __device__ __forceinline__ void frag(int nh, int s, unsigned& b0, unsigned& b1) const {
        asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(b0), "=r"(b1) : "r"(at + (nh * KSTEPS + s) * 256));
    }
#else
    unsigned f[NH][KSTEPS][2];
    __device__ __forceinline__ void frag(int nh, int s, unsigned& b0, unsigned& b1) const {
        b0 = f[nh][s][0];
        b1 = f[nh][s][1];
    }
#endif
};

template <bool FULL, class Rows>
__device__ __forceinline__ void block_step(const Rows& rows, int t0, int hi, int lane,
                                           const QueryFrags& qf, float scale_log2,
                                           float (&m)[NH][2], float (&l)[NH][2], float (&acc)[ACC_M][NH][4]) {
    const int gid = lane >> 2, tig = lane & 3;
    // Scores. m-tile mt holds positions t0 + 16 mt + gid (rows gid) and + 8 (rows gid + 8), whose
    // key codes are bc.k[2 mt] and bc.k[2 mt + 1]. C fragment: positions gid / gid + 8, heads
    // 8 nh + 2 tig + {0, 1}.
    float sc[4][NH][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
        unsigned ka[SLICE_K / 2], kb[SLICE_K / 2];
        rows.keys(mt, ka, kb);
        rows.keys_used(mt);
        const int t = t0 + 16 * mt + gid;
        const bool ok0 = FULL || t < hi, ok1 = FULL || t + 8 < hi;
#pragma unroll
        for (int nh = 0; nh < NH; ++nh) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) {
                unsigned b0, b1;
                qf.frag(nh, s, b0, b1);
                mma16816(c, ka[2 * s], kb[2 * s], ka[2 * s + 1], kb[2 * s + 1], b0, b1);
            }
            sc[mt][nh][0] = ok0 ? c[0] * scale_log2 : NEG_INF;
            sc[mt][nh][1] = ok0 ? c[1] * scale_log2 : NEG_INF;
            sc[mt][nh][2] = ok1 ? c[2] * scale_log2 : NEG_INF;
            sc[mt][nh][3] = ok1 ? c[3] * scale_log2 : NEG_INF;
        }
    }

    // Online softmax per head (heads 8 nh + 2 tig + e); a head's positions are spread over the 8
    // lanes of one tig (lane bits 2-4). The running max m moves only when a score of the
    // block exceeds it by more than RESCALE_SLACK (log2 units; the whole warp votes, so m stays
    // the same in every lane of a head); otherwise the block's probabilities are taken against the
    // old m (at most 2^RESCALE_SLACK: exact in fp32, and a 16-bit P keeps its relative precision)
    // and neither the cross-lane max nor the accumulator's rescale runs. The result is the same
    // function: each partial carries the m it was taken against, and the merges rescale by it.
    float bm[NH][2];
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            bm[nh][e] = NEG_INF;
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) bm[nh][e] = fmaxf(bm[nh][e], fmaxf(sc[mt][nh][e], sc[mt][nh][2 + e]));
        }
    bool grows = false;
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) grows |= bm[nh][0] > m[nh][0] + RESCALE_SLACK || bm[nh][1] > m[nh][1] + RESCALE_SLACK;
    if (__any_sync(0xffffffffu, grows))
    {
#pragma unroll
        for (int nh = 0; nh < NH; ++nh)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float x = bm[nh][e];
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
                const float mn = fmaxf(m[nh][e], x), ms = mn == NEG_INF ? 0.f : mn;
                const float al = exp2f(m[nh][e] - ms);
                m[nh][e] = mn;
                l[nh][e] *= al;
#if VPAIR
                // The accumulator holds head tig (see the values below); head 2 tig' + e's factor
                // is in every lane of tig' (one m per head across its 8 lanes).
                const float at = __shfl_sync(0xffffffffu, al, (lane & ~3) | (tig >> 1));
                if ((tig & 1) == e)
#pragma unroll
                    for (int u = 0; u < ACC_M; ++u)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[u][0][c] *= at;
#else
#pragma unroll
                for (int j = 0; j < D / 16; ++j) {
                    acc[j][nh][e] *= al;
                    acc[j][nh][2 + e] *= al;
                }
#endif
            }
    }
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float ms = m[nh][e] == NEG_INF ? 0.f : m[nh][e];
            float rs = 0.f;
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                sc[mt][nh][e] = exp2f(sc[mt][nh][e] - ms);
                sc[mt][nh][2 + e] = exp2f(sc[mt][nh][2 + e] - ms);
                rs += sc[mt][nh][e] + sc[mt][nh][2 + e];
            }
            l[nh][e] += rs;
        }

#if VPAIR
    // Values, paired (G <= 4): O = sum_t P[t, h] V[t, ch] as C[m, n] = sum_k A[m, k] B[k, n] with
    // k = (position slot sigma, parity pi), n = (head h, parity pi'): A[m, (sigma, pi)] =
    // V[t(sigma), ch(m) + pi], B[(sigma, pi), (h, pi')] = P[t(sigma), h] if pi == pi' else 0. A
    // fragment word then holds two channels of one position, exactly as a centroid gather lands
    // it, so no transposes; the N = 8 columns are 4 heads x 2 parities (the half that GQA 4 left
    // idle in the other layout). m-tile u of the D / 32: row gid is channels gid * SLICE_V + 4 u +
    // {0, 1}, row gid + 8 the next two; k-step (i, s) holds positions 16 i + 4 s + tig (sigma =
    // tig) and + 8 (sigma = tig + 4). The C fragment: head tig, channels gid * SLICE_V + 4 u + 0..3.
    // B: thread (gid, tig) needs P of head gid >> 1 at those two positions, which one score lane
    // packs as a pair: lane (4 s + tig) * 4 + (gid >> 2), element (gid >> 1) & 1.
    {
        const int src0 = 4 * tig + (gid >> 2);
        const bool odd_head = (gid >> 1) & 1;
        const unsigned sel0 = (gid & 1) ? 0x1044u : 0x4410u, sel1 = (gid & 1) ? 0x3244u : 0x4432u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned pe = pack2(sc[i][0][0], sc[i][0][2]), po = pack2(sc[i][0][1], sc[i][0][3]);
            unsigned vv[4][SLICE_V / 2];
#pragma unroll
            for (int r = 0; r < 4; ++r) rows.values(i, r, vv[r]);
            rows.values_used(i);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const unsigned xe = __shfl_sync(0xffffffffu, pe, src0 + 16 * s);
                const unsigned xo = __shfl_sync(0xffffffffu, po, src0 + 16 * s);
                const unsigned x = odd_head ? xo : xe;
                const unsigned b0 = __byte_perm(x, 0u, sel0), b1 = __byte_perm(x, 0u, sel1);
#pragma unroll
                for (int u = 0; u < ACC_M; ++u)
                    mma16816(acc[u][0], vv[2 * s][2 * u], vv[2 * s][2 * u + 1], vv[2 * s + 1][2 * u],
                             vv[2 * s + 1][2 * u + 1], b0, b1);
            }
        }
    }
#else
    // Values. k-step i = positions t0 + 16 i + r (r = 0..15). The B fragment (P^T) of thread
    // (gid, tig) is head 8 nh + gid at r = 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9; the score C
    // fragment holding them is in lanes (2 tig) * 4 + gid / 2 and (2 tig + 1) * 4 + gid / 2, each
    // packing its (r, r + 8) pair per head parity. The A fragment (V^T): m-tile j, rows gid and
    // gid + 8 are channels gid * SLICE_V + 2 j and + 1, at the same four positions (bc.v[i][0..3]).
    const int src_a = (2 * tig) * 4 + (gid >> 1), src_b = src_a + 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned pb0[NH], pb1[NH];
#pragma unroll
        for (int nh = 0; nh < NH; ++nh) {
            const unsigned pe = pack2(sc[i][nh][0], sc[i][nh][2]), po = pack2(sc[i][nh][1], sc[i][nh][3]);
            const unsigned ea = __shfl_sync(0xffffffffu, pe, src_a), oa = __shfl_sync(0xffffffffu, po, src_a);
            const unsigned eb = __shfl_sync(0xffffffffu, pe, src_b), ob = __shfl_sync(0xffffffffu, po, src_b);
            const unsigned fa = (gid & 1) ? oa : ea, fb = (gid & 1) ? ob : eb;
            pb0[nh] = __byte_perm(fa, fb, 0x5410);
            pb1[nh] = __byte_perm(fa, fb, 0x7632);
        }
        unsigned vv[4][SLICE_V / 2];
#pragma unroll
        for (int r = 0; r < 4; ++r) rows.values(i, r, vv[r]);
        rows.values_used(i);
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
            const unsigned a0 = __byte_perm(vv[0][j], vv[1][j], 0x5410), a1 = __byte_perm(vv[0][j], vv[1][j], 0x7632);
            const unsigned a2 = __byte_perm(vv[2][j], vv[3][j], 0x5410), a3 = __byte_perm(vv[2][j], vv[3][j], 0x7632);
#pragma unroll
            for (int nh = 0; nh < NH; ++nh) mma16816(acc[j][nh], a0, a1, a2, a3, pb0[nh], pb1[nh]);
        }
    }
#endif
}

// A float written by another CTA of this launch (after its fence): read past L1, which is not
// coherent across SMs.
__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ vq_f4 load_cg4(const float* p) {
    vq_f4 v;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

#define MERGE_BATCH 16  // partials a merging thread loads before it combines them

#if CLUSTER
// MAX_CLUSTER (a define): the largest cluster the launch makes, the portable size 8.

// Distributed shared memory (sm_90): the barrier of every thread of the cluster (release/acquire:
// shared-memory writes before it are seen by every CTA of the cluster after it), this CTA's rank,
// and loads from another CTA's shared memory at the address of the same variable there.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ unsigned cluster_address(unsigned addr, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}

__device__ __forceinline__ float load_cluster(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ vq_f4 load_cluster4(unsigned addr) {
    vq_f4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}
#endif

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MINB)
vq_decode(const unsigned short* __restrict__ q,       // [B, Hkv * G, D]
          const unsigned char* __restrict__ kcodes,  // [B, Hkv, Tmax, D / DK] codes
          const unsigned char* __restrict__ vcodes,  // [B, Hkv, Tmax, D / DV] codes
          const unsigned short* __restrict__ kcent,  // [EK, DK] 16-bit, 16-byte aligned
          const unsigned short* __restrict__ vcent,  // [EV, DV] 16-bit, 16-byte aligned
          const unsigned short* __restrict__ kw,     // [B, Hkv, R, D] (K~), 16-byte aligned
          const unsigned short* __restrict__ vw,     // [B, Hkv, R, D]
          const void* __restrict__ n_coded_p,        // 0-d int32/int64
          const void* __restrict__ n_window_p,       // 0-d int32/int64
          const void* __restrict__ start_p,          // [B] int32/int64, or unused
          float* __restrict__ part_m,                // [B * Hkv, splits, G]
          float* __restrict__ part_l,                // [B * Hkv, splits, G]
          float* __restrict__ part_acc,              // [B * Hkv, splits, G, D]
          unsigned* __restrict__ arrivals,           // [B * Hkv], zeros; left zero
          unsigned short* __restrict__ out,          // [B, Hkv * G, D]
          int hkv, int tmax, int r_slots, int n_coded_is64, int n_window_is64, int start_kind,
          float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
#if !CLUSTER
    __shared__ int last_arrival;
#endif
    // The books' region: the dynamic shared memory's start, or (INTERLEAVE) its first 64 KiB
    // boundary, for which the launch gives 64 KiB more than the books take.
#if INTERLEAVE
    const unsigned smem_at = shared_address(smem), book_at = (smem_at + 0xffffu) & ~0xffffu;
    unsigned dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
    if (book_at + BOOK_REGION > smem_at + dynamic_bytes) __trap();  // the launch gave too little
    unsigned short* kbook = (unsigned short*)(smem + (book_at - smem_at));
    unsigned short* vbook = kbook + 64;  // the value book: the second half of each 256-byte row
#else
    unsigned short* kbook = (unsigned short*)smem;
    unsigned short* vbook = (unsigned short*)(smem + EK * KCOPIES * DK * KELEM);
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int bh = blockIdx.x, b = bh / hkv, kvh = bh - b * hkv;
    // The global reads a warp needs first (the single-copy books, the lengths, the query, its first
    // block of codes, the centroids) are all issued before the codebook fill's barrier, so that at
    // short lengths their latencies overlap instead of adding up.
#if KCOPIED + VCOPIED
    copy_books(kcent, vcent, kbook, vbook);
#endif
    const int n_coded = min(read_index(n_coded_p, 0, n_coded_is64), tmax);
    const int n_window = min(read_index(n_window_p, 0, n_window_is64), r_slots);
    const int start = start_kind ? read_index(start_p, b, start_kind == 2) : 0;

    // Query fragments (see QueryFrags). QSMEM: warp 0 stores them after the books, before the
    // fill's barrier.
    QueryFrags qf;
#if QSMEM
    static_assert(!INTERLEAVE, "the query's shared memory follows the books of the non-interleaved layout");
    qf.at = shared_address(smem + EK * KCOPIES * DK * KELEM + EV * VCOPIES * DV * VELEM) + lane * 8;
    if (warp == 0)
#endif
    {
        const unsigned short* qrow = q + ((long long)b * hkv * G + kvh * G) * D + tig * SLICE_K;
#pragma unroll
        for (int nh = 0; nh < NH; ++nh) {
            const int h = 8 * nh + gid;
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) {
                const unsigned b0 = h < G ? *(const unsigned*)(qrow + h * D + 4 * s) : 0u;
                const unsigned b1 = h < G ? *(const unsigned*)(qrow + h * D + 4 * s + 2) : 0u;
#if QSMEM
                asm volatile("st.shared.v2.u32 [%0], {%1,%2};" :: "r"(qf.at + (nh * KSTEPS + s) * 256), "r"(b0), "r"(b1) : "memory");
#else
                qf.f[nh][s][0] = b0;
                qf.f[nh][s][1] = b1;
#endif
            }
        }
    }

    float m[NH][2], l[NH][2], acc[ACC_M][NH][4];
#pragma unroll
    for (int nh = 0; nh < NH; ++nh) {
        m[nh][0] = m[nh][1] = NEG_INF;
        l[nh][0] = l[nh][1] = 0.f;
#pragma unroll
        for (int j = 0; j < ACC_M; ++j) acc[j][nh][0] = acc[j][nh][1] = acc[j][nh][2] = acc[j][nh][3] = 0.f;
    }

    // This unit's blocks [b0, b1) of the coded blocks (cb of them, the last one partial) and then
    // the window's: coded positions [lo, hi), window slots [wlo, whi), both from the row's start on.
    const int units = gridDim.y * NWARPS, unit = blockIdx.y * NWARPS + warp;
    const int cb = (n_coded + BLOCK_T - 1) / BLOCK_T, wb = (n_window + BLOCK_T - 1) / BLOCK_T;
    const int per_unit = (cb + wb + units - 1) / units;
    const int b0 = unit * per_unit, b1 = min(b0 + per_unit, cb + wb);
    const int lo = max(b0 * BLOCK_T, start), hi = min(min(b1, cb) * BLOCK_T, n_coded);
    const int wlo = max(max(b0 - cb, 0) * BLOCK_T, start - n_coded), whi = min(max(b1 - cb, 0) * BLOCK_T, n_window);
    const unsigned char* kc = kcodes + (long long)bh * tmax * KROW_BYTES;
    const unsigned char* vc = vcodes + (long long)bh * tmax * VROW_BYTES;
    // Software pipeline over the coded blocks: the next block's codes load while this one computes
    // (STAGGER: into the registers of this block's codes, as each part of them is used).
    int t0 = lo;
    BlockCodes cur;
    if (t0 < hi) load_block(cur, t0, hi, kc, vc, gid, tig);
#if KCOPIED + VCOPIED
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
    fill_books(kcent, vcent, kbook, vbook, warp, lane);
    __syncthreads();
    // Lane l reads copy l % COPIES of each codebook.
    const unsigned kbase = shared_address(kbook) + (lane % KCOPIES) * DK * 2;
    const unsigned vbase = shared_address(vbook) + (lane % VCOPIES) * DV * 2;
    // A byte book's step follows its EK x DK bytes (see byte_book in decode.py).
    const ByteStep kstep = byte_step(KBYTE ? *(const float*)((const unsigned char*)kcent + EK * DK) : 0.f);
    const ByteStep vstep = byte_step(VBYTE ? *(const float*)((const unsigned char*)vcent + EV * DV) : 0.f);
#if STAGGER
    for (; t0 + BLOCK_T <= hi; t0 += BLOCK_T) {
        const CodebookRows<true> rows{cur, kbase, vbase, kstep, vstep, t0 + BLOCK_T, hi, kc, vc, gid, tig};
        block_step<true>(rows, t0, hi, lane, qf, scale_log2, m, l, acc);
    }
#else
    for (; t0 + BLOCK_T <= hi; t0 += BLOCK_T) {
        BlockCodes nxt;
        load_block(nxt, t0 + BLOCK_T, hi, kc, vc, gid, tig);
        block_step<true>(CodebookRows<false>{cur, kbase, vbase, kstep, vstep}, t0, hi, lane, qf, scale_log2, m, l, acc);
        cur = nxt;
    }
#endif
    if (t0 < hi) block_step<false>(CodebookRows<false>{cur, kbase, vbase, kstep, vstep}, t0, hi, lane, qf, scale_log2, m, l, acc);
    const long long wrow = (long long)bh * r_slots * D;
    for (int s0 = wlo; s0 < whi; s0 += BLOCK_T) {
        const int n = min(BLOCK_T, whi - s0);
        const DenseRows rows{kw + wrow + (long long)s0 * D, vw + wrow + (long long)s0 * D, n, gid, tig};
        block_step<false>(rows, 0, n, lane, qf, scale_log2, m, l, acc);
    }

    // Each warp's partial (head 8 nh + 2 tig + e; its sum spread over the lanes of one tig) goes
    // to shared memory (the codebooks are no longer needed), then the CTA merges its NWARPS
    // partials into one: the final merge reads one partial per CTA, not one per warp.
    __syncthreads();
    float* wm = (float*)smem;       // [NWARPS][G]
    float* wl = wm + NWARPS * G;    // [NWARPS][G]
    float* wacc = wl + NWARPS * G;  // [NWARPS][G][D]
#pragma unroll
    for (int nh = 0; nh < NH; ++nh)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float ls = l[nh][e];
            ls += __shfl_xor_sync(0xffffffffu, ls, 4);
            ls += __shfl_xor_sync(0xffffffffu, ls, 8);
            ls += __shfl_xor_sync(0xffffffffu, ls, 16);
            const int h = 8 * nh + 2 * tig + e;
            if (h < G) {
                if (gid == 0) {
                    wm[warp * G + h] = m[nh][e];
                    wl[warp * G + h] = ls;
                }
#if !VPAIR
                // Channels gid * SLICE_V + 2 j (C rows gid) and + 1 (rows gid + 8).
                float* dst = wacc + (warp * G + h) * D + gid * SLICE_V;
#pragma unroll
                for (int j = 0; j < D / 16; j += 2) {
                    vq_f4 v;
                    v.x = acc[j][nh][e]; v.y = acc[j][nh][2 + e];
                    v.z = acc[j + 1][nh][e]; v.w = acc[j + 1][nh][2 + e];
                    *(vq_f4*)(dst + 2 * j) = v;
                }
#endif
            }
        }
#if VPAIR
    if (tig < G) {  // head tig, channels gid * SLICE_V + 4 u + 0..3
        float* dst = wacc + (warp * G + tig) * D + gid * SLICE_V;
#pragma unroll
        for (int u = 0; u < ACC_M; ++u) {
            vq_f4 v;
            v.x = acc[u][0][0]; v.y = acc[u][0][1]; v.z = acc[u][0][2]; v.w = acc[u][0][3];
            *(vq_f4*)(dst + 4 * u) = v;
        }
    }
#endif
    __syncthreads();
#if CLUSTER
    float* cacc = wacc + NWARPS * G * D;  // [G][D] this CTA's partial, read by the whole cluster
    float* cm = cacc + G * D;             // [G]
    float* cl = cm + G;                   // [G]
#else
    const long long prow = ((long long)bh * gridDim.y + blockIdx.y) * G;
#endif
    for (int i = threadIdx.x; i < G * D; i += NWARPS * 32) {
        const int h = i / D, c = i - h * D;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, wm[w * G + h]);
        const float ms = mx == NEG_INF ? 0.f : mx;
        float a = 0.f, ls = 0.f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float wt = exp2f(wm[w * G + h] - ms);
            a += wt * wacc[(w * G + h) * D + c];
            ls += wt * wl[w * G + h];
        }
#if CLUSTER
        cacc[i] = a;
        if (c == 0) {
            cm[h] = mx;
            cl[h] = ls;
        }
#else
        part_acc[(prow + h) * D + c] = a;
        if (c == 0) {
            part_m[prow + h] = mx;
            part_l[prow + h] = ls;
        }
#endif
    }
#if CLUSTER
    // Every CTA's partial is in its shared memory; CTA `rank` merges outputs 4 (rank * threads +
    // thread) .. + 3, loading the cluster's partials (gridDim.y <= MAX_CLUSTER of them) before it
    // combines any. The second barrier keeps each CTA's shared memory alive until all have read it.
    cluster_sync();
    {
        const int parts = gridDim.y;
        const unsigned rank = cluster_rank();
        const unsigned acc_at = shared_address(cacc), m_at = shared_address(cm), l_at = shared_address(cl);
        unsigned short* orow = out + ((long long)b * hkv + kvh) * G * D;
        for (int i = 4 * (rank * NWARPS * 32 + threadIdx.x); i < G * D; i += 4 * NWARPS * 32 * parts) {
            const int h = i / D;
            float mu[MAX_CLUSTER], lu[MAX_CLUSTER];
            vq_f4 au[MAX_CLUSTER];
#pragma unroll
            for (int j = 0; j < MAX_CLUSTER; ++j) {
                if (j >= parts) break;
                mu[j] = load_cluster(cluster_address(m_at + 4 * h, j));
                lu[j] = load_cluster(cluster_address(l_at + 4 * h, j));
                au[j] = load_cluster4(cluster_address(acc_at + 4 * i, j));
            }
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < MAX_CLUSTER; ++j) if (j < parts) mx = fmaxf(mx, mu[j]);
            const float ms = mx == NEG_INF ? 0.f : mx;
            float ls = 0.f, a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < MAX_CLUSTER; ++j) {
                if (j >= parts) break;
                const float wt = exp2f(mu[j] - ms);
                ls += wt * lu[j];
                a[0] += wt * au[j].x;
                a[1] += wt * au[j].y;
                a[2] += wt * au[j].z;
                a[3] += wt * au[j].w;
            }
            const float inv = ls > 0.f ? 1.f / ls : 0.f;
            vq_w2 o;
            o.x = pack2(a[0] * inv, a[1] * inv);
            o.y = pack2(a[2] * inv, a[3] * inv);
            *(vq_w2*)(orow + i) = o;
        }
    }
    cluster_sync();
#else

    // The last CTA of this (batch row, KV head) to arrive merges every CTA's partial. The barrier
    // orders the CTA's partial writes before thread 0's atomic, whose release makes them visible to
    // the CTA that acquires the last count (the split-K semaphore pattern).
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(arrivals + bh) : "memory");
        last_arrival = before == gridDim.y - 1;
        if (last_arrival) arrivals[bh] = 0u;  // every CTA has counted: zero for the next launch
    }
    __syncthreads();
    if (!last_arrival) return;
    // Online log-sum-exp over the partials, 4 channels per thread: every load of a batch of
    // MERGE_BATCH partials is issued before any is combined (one round trip per batch; a loop that
    // loaded a partial per step paid one per partial: docs/studies/decode-kernel-bounds.md).
    const int parts = gridDim.y;
    const long long row0 = (long long)bh * parts * G;
    unsigned short* orow = out + ((long long)b * hkv + kvh) * G * D;
    for (int i = 4 * threadIdx.x; i < G * D; i += 4 * NWARPS * 32) {
        const int h = i / D, c = i - h * D;
        float mx = NEG_INF, ls = 0.f, a[4] = {0.f, 0.f, 0.f, 0.f};
        for (int u0 = 0; u0 < parts; u0 += MERGE_BATCH) {
            float mu[MERGE_BATCH], lu[MERGE_BATCH];
            vq_f4 au[MERGE_BATCH];
#pragma unroll
            for (int j = 0; j < MERGE_BATCH; ++j) {
                const long long p = row0 + min(u0 + j, parts - 1) * G + h;  // past the last: reloads it, unused
                mu[j] = load_cg(part_m + p);
                lu[j] = load_cg(part_l + p);
                au[j] = load_cg4(part_acc + p * D + c);
            }
#pragma unroll
            for (int j = 0; j < MERGE_BATCH; ++j) {
                if (u0 + j >= parts) break;
                const float mn = fmaxf(mx, mu[j]), ms = mn == NEG_INF ? 0.f : mn;
                const float s_old = exp2f(mx - ms), s_new = exp2f(mu[j] - ms);
                ls = ls * s_old + lu[j] * s_new;
                a[0] = a[0] * s_old + au[j].x * s_new;
                a[1] = a[1] * s_old + au[j].y * s_new;
                a[2] = a[2] * s_old + au[j].z * s_new;
                a[3] = a[3] * s_old + au[j].w * s_new;
                mx = mn;
            }
        }
        const float inv = ls > 0.f ? 1.f / ls : 0.f;
        vq_w2 o;
        o.x = pack2(a[0] * inv, a[1] * inv);
        o.y = pack2(a[2] * inv, a[3] * inv);
        *(vq_w2*)(orow + i) = o;
    }
#endif
}
