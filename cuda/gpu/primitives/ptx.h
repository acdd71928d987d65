// Thin wrappers over the PTX instructions the kernels are built from: cp.async,
// ldmatrix, mma.sync, ex2 and tanh. Everything else in gpu/ is plain C++ over these.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace jaxflash::gpu {

// Address in the .shared window, as ldmatrix and cp.async take it.
__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// x, through an instruction the compiler cannot see through: what derives from
// it is computed where it is used, not hoisted out of an enclosing loop. The
// persistent sm_90 forward's loop over tiles needs it: hoisted out of that loop,
// the epilogue's per-lane shared-memory addresses stayed live across the main
// loop, and spilled.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
  return x;
}
__device__ __forceinline__ char* opaque(char* x) {
  asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
  return x;
}

// One 32-bit shared-memory load by shared address (the fp32 fragments that
// ldmatrix cannot transpose).
__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
// One 32-bit shared-memory store by shared address (addresses formed by XOR:
// GmmaTile::origin_at).
__device__ __forceinline__ void sts_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// 16-byte asynchronous global->shared copy. .cg: stream through L2 only; K/V
// are reused across CTAs, not within one.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// Same, reading only `src_bytes` (0..16) and zero-filling the rest: tails of
// rows and head dims come for free, and src_bytes == 0 reads nothing at all
// (out-of-range rows).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

// One 4-byte element, zero-filled when src_bytes is 0 (nothing is read then):
// the row-wise words of a tile (segment ids), whatever the source's stride.
__device__ __forceinline__ void cp_async_4_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N committed groups are still in flight (this thread's).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i,
// and r[i] receives this lane's piece of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Same, each matrix transposed on the way (V is stored [key][dim] but PV needs
// it as the k-major B operand).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D += A * B, m16n8k16, fp32 accumulate. Not volatile: a pure function of its
// registers, so the compiler may interleave it with the fragment loads.
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             __half) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             __nv_bfloat16) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D += A * B, m16n8k8 on tf32 operands, fp32 accumulate (the float32 path).
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Round an fp32 bit pattern to tf32 (nearest, ties away), so the tensor core
// sees a rounded operand rather than a truncated one.
__device__ __forceinline__ uint32_t to_tf32(uint32_t x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(__uint_as_float(x)));
  return r;
}

// How float32 operands meet the tensor cores (16-bit operands are exact in the
// MMA already, so this is a float32-only choice; AttentionParams' kExactF32):
//   kTf32    one tf32 MMA per product, operands rounded to tf32 (10-bit
//            mantissa): JAX's default float32 matmul precision on these GPUs.
//   kTf32WholeP  as kTf32, but the forward's P goes into P.V whole (mma.h's
//            PvOps): the differentiated forward's (kOutputF32), whose O the
//            backward's delta = rowsum(dO O) reads.
//   k3xTf32  fp32-accurate products: each operand x = big + small with
//            big = tf32(x), small = tf32(x - big), and a * b accumulated as
//            small_a big_b + big_a small_b + big_a big_b (the dropped
//            small_a small_b is ~2^-22 |a b|). Three MMAs per product.
enum class F32Mma { kTf32, kTf32WholeP, k3xTf32 };

// An fp32 fragment split into two tf32 fragments, x ~= big + small.
template <int N>
struct Tf32Split {
  uint32_t big[N], small[N];
};

// The registers an fp32 operand fragment of N words occupies on its way into
// the MMA: rounded to tf32, or split.
template <F32Mma M, int N>
using Tf32Frag = std::conditional_t<M == F32Mma::k3xTf32, Tf32Split<N>, uint32_t[N]>;

// x = big + small up to ~2^-22 |x|: x - big is exact in fp32 (it is made of
// the 13 low bits of x's significand), and rounding it to tf32 drops the last
// two of them.
__device__ __forceinline__ void split_tf32(uint32_t x, uint32_t& big, uint32_t& small) {
  big = to_tf32(x);
  small = to_tf32(__float_as_uint(__uint_as_float(x) - __uint_as_float(big)));
}

// Raw fp32 bits x -> word i of an operand fragment: rounded (kTf32) or split
// (k3xTf32).
template <int N>
__device__ __forceinline__ void tf32_operand(uint32_t (&f)[N], int i, uint32_t x) {
  f[i] = to_tf32(x);
}
template <int N>
__device__ __forceinline__ void tf32_operand(Tf32Split<N>& f, int i, uint32_t x) {
  split_tf32(x, f.big[i], f.small[i]);
}

// The N registers of a fragment that can take its raw fp32 bits, for a load
// that fills them and then converts in place (tf32_operand(f, i, fp32_bits(f)[i])).
template <int N>
__device__ __forceinline__ uint32_t (&fp32_bits(uint32_t (&f)[N]))[N] {
  return f;
}
template <int N>
__device__ __forceinline__ uint32_t (&fp32_bits(Tf32Split<N>& f))[N] {
  return f.big;
}

// D += A * B to fp32 accuracy on split operands (3xTF32, see F32Mma). The
// tensor cores do not round their accumulation to nearest as fp32 adds do, and
// three MMAs per k-step into one running accumulator lost up to ~1e-5 on
// N(0,1) inputs (H100: dv, dk 1.4-1.6e-5 where XLA's float32 is off by 1-2e-6).
// So the three MMAs of a k-step sum into a fresh zero fragment (the two cross
// terms, ~2^-11 of the product each, first: smallest first), and each k-step's
// sum is added to D by fp32 FADDs. Cost: 4 FADDs per 3 MMAs, about one MMA's
// time: precision="highest" is 1.11-1.26x slower forward, 1.17-1.21x backward.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const Tf32Split<4>& a, const Tf32Split<2>& b) {
  float step[4] = {0.f, 0.f, 0.f, 0.f};
  mma_m16n8k8_tf32(step, a.small, b.big);
  mma_m16n8k8_tf32(step, a.big, b.small);
  mma_m16n8k8_tf32(step, a.big, b.big);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] += step[i];
}

// 2^x on the SFU; ex2(-inf) = +0, which is what masked scores rely on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh on the SFU (sm_75 and later): one MUFU op, relative error about 2^-11 (PTX ISA);
// tanh(+-inf) = +-1.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The soft-cap's tanh for inputs of type T. 16-bit inputs take the SFU's tanh.approx (relative
// error ~2^-11, at or below what their logits carry: jax.nn rounds 16-bit logits at 2^-9 /
// 2^-11), one instruction where tanhf takes ~20 (with tanhf the soft-cap cost the forward
// 55-65% on the H100); float32 needs tanhf's accuracy. Every kernel of a dtype, forward and
// backward, takes the same one, so that the backward recomputes the forward's capped logits.
template <class T>
__device__ __forceinline__ float soft_cap_tanh(float x) {
  if constexpr (sizeof(T) == 2) return fast_tanh(x);
  else return tanhf(x);
}

// Two floats packed into the 32-bit register layout of a 16-bit fragment pair
// (lower address = lower half).
__device__ __forceinline__ uint32_t pack2(float lo, float hi, __half) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace jaxflash::gpu
