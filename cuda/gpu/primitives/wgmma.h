// Hopper warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors and
// the m64nNk16 products the sm_90 backward is built from (bwd_sm90_kernel.h).
//
// A warpgroup (4 warps, 128 threads) multiplies a 64 x 16 A by a 16 x N B
// into a 64 x N fp32 accumulator. B always comes from shared memory through a
// 64-bit descriptor; A from shared memory too ("SS") or from registers
// ("RS"). The tensor cores read shared memory themselves, so no thread spends
// issue slots or registers on operand fragments: what limits the mma.sync
// kernels (every fragment an ldmatrix) is gone.
//
// Register layouts match mma.sync's (warp_gemm.h), so softmax, masking and
// the epilogues keep their fragment code: warp w of the warpgroup owns
// accumulator rows [16 w, 16 w + 16), held as N / 8 m16n8 C fragments
// (Acc<N>, i.e. float[1][N / 8][4]); an RS A operand is the m16n8k16 A
// fragment of the warp's 16 rows. The accumulator of a product over k
// therefore converts to the A operand of the next one (a_operand).
//
// Operands are GmmaTiles (smem_tile.h, 128-byte swizzle). A tile serves as
//   K-major:  its contiguous columns are the GEMM's k (Q K^T reads K and Q so);
//   MN-major: its contiguous columns are m or n, its rows k (dV = P^T dO
//             reads dO so); the instruction transposes on the way.
// Both for 16-bit types only.
//
// Ordering. wgmma is asynchronous: an instruction only issues the product;
// commit() closes a group, wait<N>() blocks until at most N groups are in
// flight. fence() must precede the first wgmma after registers it reads (an
// accumulator, an RS A operand) were written by ordinary instructions. Shared
// memory written by ordinary stores or cp.async must be made visible to the
// tensor cores' (async) proxy with fence_proxy_async_shared (dq_order.h)
// before the barrier that publishes it. The compiler does not know an
// accumulator changes at wait(): hold_acc() after the wait keeps reads of it
// from moving above. (ptxas itself tracks the registers in flight.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "smem_tile.h"

// Builds for cc 9.0 must target sm_90a, which alone has wgmma: a plain sm_90
// cubin would leave the Hopper kernels empty on an H100.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "jaxflash: build for sm_90a, not sm_90 (JAXFLASH_CUDA_ARCHITECTURES=90a)"
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JF_WGMMA 1
#else
#define JF_WGMMA 0
#endif

namespace jaxflash::gpu {

template <int N>
using Acc = float[1][N / 8][4];

// ---- Descriptors ----
//
// Fields (PTX ISA, "matrix descriptor"): start address >> 4 (bits 0-13),
// leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), base
// offset (49-51, 0: the tiles are 1024-byte aligned), swizzle mode (62-63,
// 1 = 128 bytes). With the 128-byte swizzle:
//   K-major:  stride = 1024 (from one 8-row group to the next); leading unused.
//   MN-major: stride = 1024 (8 k-rows to the next 8); leading = from one
//             64-element column block to the next (the tile's block bytes).
// A k step of 16 moves a K-major start 32 bytes along the 128-byte row, then
// to the next column block (the swizzle applies to the absolute address, so
// the offset commutes with it), and an MN-major start 16 rows down.
//
// GmmaOperand<Tile, kMnMajor> is an operand's descriptor at its origin (rows
// from row0 for K-major, columns from col0 for MN-major); step(kk) is k step
// kk's, one add to the low word. The origin's address goes through an empty
// asm so that the compiler recomputes the steps where they are used instead
// of hoisting every step's 64-bit descriptor out of the loops (a register
// pair each, dozens per kernel).
template <class Tile, bool kMnMajor>
struct GmmaOperand {
  static constexpr uint32_t kHigh = (1u << 30) | (1024 >> 4);  // 128-byte swizzle, stride 1024
  uint32_t low;  // start address >> 4, leading byte offset >> 4 at bit 16

  __device__ __forceinline__ GmmaOperand(const Tile& t, int origin) {
    uint32_t start = smem_addr(t.ptr) + (kMnMajor ? (origin / Tile::kBlockCols) * Tile::kBlockBytes : origin * 128);
    asm volatile("" : "+r"(start));
    const uint32_t leading = kMnMajor ? Tile::kBlockBytes : 16;
    low = ((start & 0x3FFFF) >> 4) | ((leading >> 4) << 16);
  }
  __device__ __forceinline__ uint64_t step(int kk) const {
    const int off = kMnMajor ? kk * 16 * 128 : (kk / 4) * Tile::kBlockBytes + (kk % 4) * 32;
    return (static_cast<uint64_t>(kHigh) << 32) | (low + static_cast<uint32_t>(off >> 4));
  }
};

// ---- Synchronisation ----

__device__ __forceinline__ void wgmma_fence() {
#if JF_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if JF_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if JF_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// wgmma_wait<N>, kept below the work that program order puts before it. ptxas
// schedules a wgmma wait near the top of its basic block, above independent
// instructions: the forward's wait for P V went above the softmax's exp2s it was
// meant to overlap, in every sm_90 copy (SASS), so that a warpgroup's softmax never
// ran beside its own product. A branch ptxas cannot fold ends the block first:
// `opaque` is any value unknown at compile time; its no-op is harmless if it runs.
template <int N>
__device__ __forceinline__ void wgmma_wait_in_order(uint32_t opaque) {
  if (opaque == 0xffffffffu) asm volatile("nanosleep.u32 0;\n");
  wgmma_wait<N>();
}
template <int NF>
__device__ __forceinline__ void hold_acc(float (&d)[1][NF][4]) {
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[0][nf][e])::"memory");
}

// ---- The products ----

// The instruction strings, TY = ".f16" or ".bf16". Operands: the N / 2
// accumulators, then (SS) the A and B descriptors, or (RS) A's four registers
// and B's descriptor; then `accumulate` (d = A.B + d, else d = A.B) and the
// transpose immediates. A and B are scaled by 1.
#define JF_ACC_32                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define JF_ACC_64                                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define JF_ACC_128                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "      \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "       \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "        \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "        \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "        \
  "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, "   \
  "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, " \
  "%125, %126, %127}"
#define JF_ACC_80 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"
#define JF_WGMMA_SS_N64(TY)                                                        \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                     \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32" TY TY " " JF_ACC_32 ", %32, %33, " \
  "p, 1, 1, %35, %36;\n}\n"
#define JF_WGMMA_SS_N128(TY)                                                        \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                      \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32" TY TY " " JF_ACC_64 ", %64, %65, " \
  "p, 1, 1, %67, %68;\n}\n"
#define JF_WGMMA_SS_N160(TY)                                                        \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"                                      \
  "wgmma.mma_async.sync.aligned.m64n160k16.f32" TY TY " " JF_ACC_80 ", %80, %81, " \
  "p, 1, 1, %83, %84;\n}\n"
#define JF_WGMMA_RS_N64(TY)                                                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                       \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32" TY TY " " JF_ACC_32 ", {%32, %33, %34, %35}, %36, " \
  "p, 1, 1, %38;\n}\n"
#define JF_WGMMA_RS_N128(TY)                                                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                        \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32" TY TY " " JF_ACC_64 ", {%64, %65, %66, %67}, %68, " \
  "p, 1, 1, %70;\n}\n"
#define JF_WGMMA_RS_N256(TY)                                                                           \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                        \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32" TY TY " " JF_ACC_128 ", {%128, %129, %130, %131}, %132, " \
  "p, 1, 1, %134;\n}\n"
#define JF_OPS8(f, i)                                                                                   \
  "+f"(f[i]), "+f"(f[i + 1]), "+f"(f[i + 2]), "+f"(f[i + 3]), "+f"(f[i + 4]), "+f"(f[i + 5]), \
      "+f"(f[i + 6]), "+f"(f[i + 7])
#define JF_OPS32(f) JF_OPS8(f, 0), JF_OPS8(f, 8), JF_OPS8(f, 16), JF_OPS8(f, 24)
#define JF_OPS64(f) JF_OPS32(f), JF_OPS8(f, 32), JF_OPS8(f, 40), JF_OPS8(f, 48), JF_OPS8(f, 56)
#define JF_OPS80(f) JF_OPS64(f), JF_OPS8(f, 64), JF_OPS8(f, 72)
#define JF_OPS128(f)                                                                                          \
  JF_OPS64(f), JF_OPS8(f, 64), JF_OPS8(f, 72), JF_OPS8(f, 80), JF_OPS8(f, 88), JF_OPS8(f, 96), JF_OPS8(f, 104), \
      JF_OPS8(f, 112), JF_OPS8(f, 120)

// d (+)= A . B, both from shared memory. kTransA / kTransB: the operand is
// MN-major (else K-major). N = 64 or 128 (the backward's), or 160 (the sm_90
// forward's S at D = 128, tile_size.h).
template <class T, int N, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_ss(Acc<N>& d, uint64_t a, uint64_t b, bool accumulate) {
  static_assert(N == 64 || N == 128 || N == 160, "the shapes the kernels use");
#if JF_WGMMA
  float* f = &d[0][0][0];
  const int acc = accumulate;
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && bf16)
    asm volatile(JF_WGMMA_SS_N64(".bf16") : JF_OPS32(f) : "l"(a), "l"(b), "r"(acc), "n"(int{kTransA}), "n"(int{kTransB}));
  else if constexpr (N == 64)
    asm volatile(JF_WGMMA_SS_N64(".f16") : JF_OPS32(f) : "l"(a), "l"(b), "r"(acc), "n"(int{kTransA}), "n"(int{kTransB}));
  else if constexpr (N == 160 && bf16)
    asm volatile(JF_WGMMA_SS_N160(".bf16") : JF_OPS80(f) : "l"(a), "l"(b), "r"(acc), "n"(int{kTransA}), "n"(int{kTransB}));
  else if constexpr (N == 160)
    asm volatile(JF_WGMMA_SS_N160(".f16") : JF_OPS80(f) : "l"(a), "l"(b), "r"(acc), "n"(int{kTransA}), "n"(int{kTransB}));
  else if constexpr (bf16)
    asm volatile(JF_WGMMA_SS_N128(".bf16") : JF_OPS64(f) : "l"(a), "l"(b), "r"(acc), "n"(int{kTransA}), "n"(int{kTransB}));
  else
    asm volatile(JF_WGMMA_SS_N128(".f16") : JF_OPS64(f) : "l"(a), "l"(b), "r"(acc), "n"(int{kTransA}), "n"(int{kTransB}));
#else
  (void)d, (void)a, (void)b, (void)accumulate;
#endif
}

// d (+)= A . B, A from registers (a_operand), B from shared memory. N = 64 or
// 128, or 256 (the sm_90 forward's O += P V at D = 256).
template <class T, int N, bool kTransB>
__device__ __forceinline__ void wgmma_rs(Acc<N>& d, const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  static_assert(N == 64 || N == 128 || N == 256, "the shapes the kernels use");
#if JF_WGMMA
  float* f = &d[0][0][0];
  const int acc = accumulate;
  constexpr bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64 && bf16)
    asm volatile(JF_WGMMA_RS_N64(".bf16") : JF_OPS32(f) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(int{kTransB}));
  else if constexpr (N == 64)
    asm volatile(JF_WGMMA_RS_N64(".f16") : JF_OPS32(f) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(int{kTransB}));
  else if constexpr (N == 128 && bf16)
    asm volatile(JF_WGMMA_RS_N128(".bf16") : JF_OPS64(f) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(int{kTransB}));
  else if constexpr (N == 128)
    asm volatile(JF_WGMMA_RS_N128(".f16") : JF_OPS64(f) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(int{kTransB}));
  else if constexpr (bf16)
    asm volatile(JF_WGMMA_RS_N256(".bf16") : JF_OPS128(f) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(int{kTransB}));
  else
    asm volatile(JF_WGMMA_RS_N256(".f16") : JF_OPS128(f) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(int{kTransB}));
#else
  (void)d, (void)a, (void)b, (void)accumulate;
#endif
}

#undef JF_ACC_32
#undef JF_ACC_64
#undef JF_ACC_80
#undef JF_ACC_128
#undef JF_WGMMA_SS_N64
#undef JF_WGMMA_SS_N128
#undef JF_WGMMA_SS_N160
#undef JF_WGMMA_RS_N64
#undef JF_WGMMA_RS_N128
#undef JF_WGMMA_RS_N256
#undef JF_OPS8
#undef JF_OPS32
#undef JF_OPS64
#undef JF_OPS80
#undef JF_OPS128

// The RS A operand for k step j (k in [16 j, 16 j + 16)) from an accumulator
// whose columns are that k: C fragments 2 j and 2 j + 1 hold exactly the
// m16n8k16 A fragment's elements, rounded to T.
template <class T, int NF>
__device__ __forceinline__ void a_operand(uint32_t (&a)[4], const float (&c)[1][NF][4], int j) {
  a[0] = pack2(c[0][2 * j][0], c[0][2 * j][1], T{});
  a[1] = pack2(c[0][2 * j][2], c[0][2 * j][3], T{});
  a[2] = pack2(c[0][2 * j + 1][0], c[0][2 * j + 1][1], T{});
  a[3] = pack2(c[0][2 * j + 1][2], c[0][2 * j + 1][3], T{});
}

}  // namespace jaxflash::gpu
