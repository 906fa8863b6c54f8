// A 16-bit float held as its bits (u16), shared by the kernels that read or write the window dtype
// (prepended by cuda/nvrtc.py's callers). `fp16` is a -D macro at every call, so the branch folds
// away: true for float16, false for bfloat16.

typedef unsigned short u16;

// The float a float16 (fp16) or bfloat16 holds (exact).
__device__ __forceinline__ float half_bits_to_float(u16 h, bool fp16) {
    if (fp16) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    return __uint_as_float(((unsigned)h) << 16);
}

// f rounded to the nearest float16 (fp16) or bfloat16, ties to even.
__device__ __forceinline__ u16 float_to_half_bits(float f, bool fp16) {
    u16 h;
    if (fp16) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    else asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
