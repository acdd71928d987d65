// Fragment loads and the generic warp GEMM of the backward kernels, on top of
// ptx.h / smem_tile.h. The backward multiplies shared-memory tiles in every
// orientation (dV = P^T dO reads P transposed, dQ = dS K reads K as [k][n]),
// so both operands come in both storage orders:
//
//   A (m x k):  kMK: the tile is stored [m][k]    kKM: the tile is stored [k][m]
//   B (k x n):  kNK: the tile is stored [n][k]    kKN: the tile is stored [k][n]
//
// Accumulators use the m16n8 C layout of mma.h (c_row / c_col below). The k
// order inside a fragment is the natural one here for every type (the
// forward's fp32 P.V path permutes k, which only works with P in registers).
// float32 runs in either F32Mma mode (ptx.h), through BwdFrag's AFrag / BFrag /
// mma as in mma.h: warp_gemm is written once for all of them.
#pragma once

#include <cstdint>

#include "ptx.h"
#include "smem_tile.h"

namespace jaxflash::gpu {

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// Coordinates of C-fragment element i (0..3) of m-fragment mf / n-fragment nf,
// relative to the warp block: lane l = 4g + t holds rows g, g + 8 and columns
// 2t, 2t + 1 (mma.h's frag_row / frag_col, under names of the backward's own).
__device__ __forceinline__ int c_row(int mf, int i, int lane) { return 16 * mf + (lane >> 2) + 8 * (i >> 1); }
__device__ __forceinline__ int c_col(int nf, int i, int lane) { return 8 * nf + 2 * (lane & 3) + (i & 1); }

enum class AOrder { kMK, kKM };
enum class BOrder { kNK, kKN };

// M matters for float only (see F32Mma).
template <class T, F32Mma M = F32Mma::kTf32>
struct BwdFrag;

// fp16 / bf16, mma.m16n8k16. A: a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..),
// a3 (g+8, 2t+8..); B: b0 (k 2t.., n g), b1 (k 2t+8.., n g). Everything
// through ldmatrix, transposing where the tile is stored the other way.
template <class T>
struct BwdFrag16 {
  static constexpr int kK = 16;
  using AFrag = uint32_t[4];  // the registers of one operand fragment
  using BFrag = uint32_t[2];

  template <AOrder O, class Tile>
  __device__ __forceinline__ static void load_a(uint32_t (&a)[4], const Tile& t, int m0, int k0, int lane) {
    if constexpr (O == AOrder::kMK) {
      ldmatrix_x4(a, t.saddr(m0 + (lane & 15), k0 + (lane >> 4) * 8));
    } else {
      // Matrix i = lane / 8 holds (m 8(i&1).., k 8(i>>1)..), stored as rows k.
      const int i = lane >> 3;
      ldmatrix_x4_trans(a, t.saddr(k0 + (lane & 7) + (i >> 1) * 8, m0 + (i & 1) * 8));
    }
  }

  // Two n8 fragments at n0, n0 + 8.
  template <BOrder O, class Tile>
  __device__ __forceinline__ static void load_b2(uint32_t (&b)[2][2], const Tile& t, int n0, int k0, int lane) {
    uint32_t r[4];
    if constexpr (O == BOrder::kNK)
      ldmatrix_x4(r, t.saddr(n0 + (lane & 7) + ((lane >> 4) << 3), k0 + ((lane >> 3) & 1) * 8));
    else
      ldmatrix_x4_trans(r, t.saddr(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
  }

  // One n8 fragment at n0 (lanes 16..31 pass addresses too; ldmatrix ignores them).
  template <BOrder O, class Tile>
  __device__ __forceinline__ static void load_b1(uint32_t (&b)[2], const Tile& t, int n0, int k0, int lane) {
    if constexpr (O == BOrder::kNK)
      ldmatrix_x2(b, t.saddr(n0 + (lane & 7), k0 + ((lane >> 3) & 1) * 8));
    else
      ldmatrix_x2_trans(b, t.saddr(k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0));
  }

  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    mma_m16n8k16(d, a, b, T{});
  }
};

template <F32Mma M>
struct BwdFrag<__half, M> : BwdFrag16<__half> {};
template <F32Mma M>
struct BwdFrag<__nv_bfloat16, M> : BwdFrag16<__nv_bfloat16> {};

// fp32 on tf32 mma.m16n8k8. A: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
// B: b0 (k t, n g), b1 (k t+4, n g). A 16-byte chunk is 4 floats, so ldmatrix's
// 8x8 b16 matrix is an 8x4 fp32 one with lane l at (l/4, l%4): the
// non-transposed orders load with ldmatrix, the transposed ones with scalar
// loads (ldmatrix cannot transpose 32-bit elements). Operands are rounded to
// tf32 (cvt.rna) on the way, or split into big + small tf32 parts (k3xTf32):
// tf32_operand (ptx.h) turns each raw fp32 word into its fragment word(s).
template <F32Mma M>
struct BwdFrag<float, M> {
  static constexpr int kK = 8;
  using AFrag = Tf32Frag<M, 4>;
  using BFrag = Tf32Frag<M, 2>;

  template <AOrder O, class Tile>
  __device__ __forceinline__ static void load_a(AFrag& a, const Tile& t, int m0, int k0, int lane) {
    uint32_t(&r)[4] = fp32_bits(a);
    if constexpr (O == AOrder::kMK) {
      ldmatrix_x4(r, t.saddr(m0 + (lane & 15), k0 + (lane >> 4) * 4));
    } else {
      const int g = lane >> 2, q = lane & 3;
      r[0] = t.template at<uint32_t>(k0 + q, m0 + g);
      r[1] = t.template at<uint32_t>(k0 + q, m0 + g + 8);
      r[2] = t.template at<uint32_t>(k0 + q + 4, m0 + g);
      r[3] = t.template at<uint32_t>(k0 + q + 4, m0 + g + 8);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) tf32_operand(a, i, r[i]);
  }

  template <BOrder O, class Tile>
  __device__ __forceinline__ static void load_b2(BFrag (&b)[2], const Tile& t, int n0, int k0, int lane) {
    uint32_t r[2][2];
    if constexpr (O == BOrder::kNK) {
      uint32_t x[4];
      ldmatrix_x4(x, t.saddr(n0 + (lane & 7) + ((lane >> 4) << 3), k0 + ((lane >> 3) & 1) * 4));
      r[0][0] = x[0], r[0][1] = x[1], r[1][0] = x[2], r[1][1] = x[3];
    } else {
      const int g = lane >> 2, q = lane & 3;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        r[j][0] = t.template at<uint32_t>(k0 + q, n0 + 8 * j + g);
        r[j][1] = t.template at<uint32_t>(k0 + q + 4, n0 + 8 * j + g);
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) tf32_operand(b[j], 0, r[j][0]), tf32_operand(b[j], 1, r[j][1]);
  }

  template <BOrder O, class Tile>
  __device__ __forceinline__ static void load_b1(BFrag& b, const Tile& t, int n0, int k0, int lane) {
    uint32_t(&r)[2] = fp32_bits(b);
    if constexpr (O == BOrder::kNK) {
      ldmatrix_x2(r, t.saddr(n0 + (lane & 7), k0 + ((lane >> 3) & 1) * 4));
    } else {
      const int g = lane >> 2, q = lane & 3;
      r[0] = t.template at<uint32_t>(k0 + q, n0 + g);
      r[1] = t.template at<uint32_t>(k0 + q + 4, n0 + g);
    }
    tf32_operand(b, 0, r[0]), tf32_operand(b, 1, r[1]);
  }

  __device__ __forceinline__ static void mma(float (&d)[4], const AFrag& a, const BFrag& b) {
    mma_m16n8k8_tf32(d, a, b);
  }
};

// C[MF][NF] += A . B for the warp block whose first row is m0 (of A's m) and
// first column n0 (of B's n), reducing over k in [0, KDIM), UNROLL k steps at
// a time. M: the float32 MMA mode (ignored for 16-bit T).
template <class T, F32Mma M, AOrder AO, BOrder BO, int KDIM, int UNROLL, int MF, int NF, class ATile, class BTile>
__device__ __forceinline__ void warp_gemm(float (&c)[MF][NF][4], const ATile& a, int m0, const BTile& b, int n0,
                                          int lane) {
  using F = BwdFrag<T, M>;
  constexpr int kSteps = KDIM / F::kK;
  static_assert(KDIM % F::kK == 0, "whole k steps");
  constexpr int kUnroll = kSteps < UNROLL ? kSteps : UNROLL;
#pragma unroll kUnroll
  for (int step = 0; step < kSteps; ++step) {
    const int k0 = step * F::kK;
    typename F::AFrag af[MF];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) F::template load_a<AO>(af[mf], a, m0 + 16 * mf, k0, lane);
#pragma unroll
    for (int nf = 0; nf + 1 < NF; nf += 2) {
      typename F::BFrag bf[2];
      F::template load_b2<BO>(bf, b, n0 + 8 * nf, k0, lane);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        F::mma(c[mf][nf], af[mf], bf[0]);
        F::mma(c[mf][nf + 1], af[mf], bf[1]);
      }
    }
    if constexpr (NF % 2 == 1) {
      typename F::BFrag bf;
      F::template load_b1<BO>(bf, b, n0 + 8 * (NF - 1), k0, lane);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) F::mma(c[mf][NF - 1], af[mf], bf);
    }
  }
}

template <int MF, int NF>
__device__ __forceinline__ void zero_frags(float (&c)[MF][NF][4]) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[mf][nf][i] = 0.f;
}

// C fragments -> a [row][col] tile of T at the warp block (row0, col0), each
// lane storing its two adjacent columns as one 32-bit (or 64-bit) word. fp32
// keeps full precision (the tf32 rounding, or split, happens on the loads).
template <class T, int MF, int NF, class Tile>
__device__ __forceinline__ void store_frags(const Tile& t, const float (&c)[MF][NF][4], int row0, int col0, float mul,
                                            int lane) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + 16 * mf + (lane >> 2) + 8 * h, col = col0 + 8 * nf + 2 * (lane & 3);
        const float x = c[mf][nf][2 * h] * mul, y = c[mf][nf][2 * h + 1] * mul;
        if constexpr (sizeof(T) == 4)
          t.template at<float2>(row, col) = make_float2(x, y);
        else
          t.template at<uint32_t>(row, col) = pack2(x, y, T{});
      }
}

// ---- Inter-CTA ordering (the deterministic dQ accumulation) ----

// sm_90+: dQ partials go through shared memory and a bulk (TMA) reduction;
// otherwise through fp32 atomics. JAXFLASH_BWD_NO_BULK (defined for every
// translation unit, backward.cu included) forces the atomic path everywhere,
// so the sm_80 code path can be tested on a Hopper GPU.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(JAXFLASH_BWD_NO_BULK)
#define JF_BWD_DQ_BULK 1
#else
#define JF_BWD_DQ_BULK 0
#endif

__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// *ptr += v with release semantics at GPU scope: this thread's earlier writes
// (and, through a preceding barrier, its CTA's) are visible to whoever
// acquires the new value. Cheaper than a full fence (__threadfence) + atomic.
__device__ __forceinline__ void red_release_gpu(int* ptr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}

// sm_90 bulk (TMA) reduction of a contiguous shared-memory block into global
// memory: dst[i] += src[i] (fp32, at L2), `bytes` a multiple of 16, both ends
// 16-byte aligned. Issued by one thread; completion is tracked per thread
// through bulk async-groups.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, int bytes) {
#if JF_BWD_DQ_BULK
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Until this thread's bulk operations are complete, their writes visible to it.
__device__ __forceinline__ void bulk_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}
// Until this thread's bulk operations have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_reads() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}
// Orders this thread's generic-proxy accesses of the state space against
// async-proxy (bulk) ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void fence_proxy_async_global() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

}  // namespace jaxflash::gpu
