// Warp-level fragment operations for the two GEMMs of attention, per element
// type. All three types share the m16n8 fp32 accumulator ("C fragment"): lane
// l = 4g + t holds rows g and g + 8, columns 2t and 2t + 1, as
//   c[0] = (g, 2t)   c[1] = (g, 2t + 1)   c[2] = (g + 8, 2t)   c[3] = (g + 8, 2t + 1)
// so softmax, masking and the epilogue are written once against that layout;
// only the operand fragments below differ. float32 has two ways through the
// tensor cores (F32Mma, ptx.h): tf32, or 3xTF32 for fp32-accurate products;
// the GEMMs below are written once against MmaOps' AFrag / BFrag / mma, which
// are one tf32 fragment and one MMA, or a big/small split and three.
//
//   S  = Q K^T : A = Q tile [row][dim], B = K tile [key][dim]  (k = dim)
//   O += P V   : A = P (registers),     B = V tile [key][dim]  (k = key)
#pragma once

#include <cstdint>

#include "ptx.h"
#include "smem_tile.h"

namespace jaxflash::gpu {

// Coordinates of C-fragment element i (0..3) of m-fragment mf / n-fragment nf:
// row relative to the warp's first row, column relative to the tile's first.
__device__ __forceinline__ int frag_row(int mf, int i, int lane) { return 16 * mf + (lane >> 2) + 8 * (i >> 1); }
__device__ __forceinline__ int frag_col(int nf, int i, int lane) { return 8 * nf + 2 * (lane & 3) + (i & 1); }

// M matters for float only (see F32Mma).
template <class T, F32Mma M = F32Mma::kTf32>
struct MmaOps;

// fp16 / bf16: mma.m16n8k16; every operand comes from ldmatrix.
template <class T>
struct MmaOps16 {
  static constexpr int kK = 16;  // depth of one mma
  using AFrag = uint32_t[4];     // the registers of one operand fragment
  using BFrag = uint32_t[2];

  // A: 16 rows x 16 k at (row0, k0). Matrices: rows 0-7 / 8-15 x k 0-7 / 8-15,
  // in the a0..a3 order of the PTX fragment.
  template <class Tile>
  __device__ __forceinline__ static void load_a(uint32_t (&a)[4], const Tile& t, int row0, int k0, int lane) {
    ldmatrix_x4(a, t.saddr(row0 + (lane & 15), k0 + (lane >> 4) * 8));
  }

  // B for two n8 fragments: rows n0..n0+15 of a [n][k] tile, k0..k0+15.
  // b[j] is the fragment of rows n0 + 8j.., halves k0.. and k0+8..
  template <class Tile>
  __device__ __forceinline__ static void load_b2(uint32_t (&b)[2][2], const Tile& t, int n0, int k0, int lane) {
    uint32_t r[4];
    ldmatrix_x4(r, t.saddr(n0 + (lane & 7) + ((lane >> 4) << 3), k0 + ((lane >> 3) & 1) * 8));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
  }

  // B for two n8 fragments from a [k][n] tile (V: k = key, n = dim): the
  // transposing ldmatrix hands each lane keys (2t, 2t+1) of column g.
  template <class Tile>
  __device__ __forceinline__ static void load_bt2(uint32_t (&b)[2][2], const Tile& t, int k0, int n0, int lane) {
    uint32_t r[4];
    ldmatrix_x4_trans(r, t.saddr(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), n0 + (lane >> 4) * 8));
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
  }

  // P (C fragments over keys) -> A fragment of k-step kk (keys 16kk..16kk+15):
  // the C layout of two adjacent n8 tiles is exactly the m16k16 A layout, so
  // this is a conversion, not a shuffle.
  template <int NF>
  __device__ __forceinline__ static void p_to_a(uint32_t (&a)[4], const float (&s)[NF][4], int kk) {
    a[0] = pack2(s[2 * kk][0], s[2 * kk][1], T{});
    a[1] = pack2(s[2 * kk][2], s[2 * kk][3], T{});
    a[2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], T{});
    a[3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], T{});
  }

  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    mma_m16n8k16(d, a, b, T{});
  }
};

template <F32Mma M>
struct MmaOps<__half, M> : MmaOps16<__half> {};
template <F32Mma M>
struct MmaOps<__nv_bfloat16, M> : MmaOps16<__nv_bfloat16> {};

// float32: mma.m16n8k8 on tf32 (what JAX's default matmul precision means on
// these GPUs). A 16-byte chunk holds 4 floats, so ldmatrix's 8x8 b16 matrix is
// an 8x4 fp32 matrix with lane l holding (l/4, l%4): exactly the tf32 A and
// (non-transposed) B layouts. ldmatrix cannot transpose 32-bit elements, so V
// is read with scalar loads (conflict-free under the swizzle, see smem_tile.h).
// Operands are rounded to tf32 rather than left for the hardware to truncate
// (kTf32), or split into big + small tf32 parts (k3xTf32): tf32_operand (ptx.h)
// turns each raw fp32 word into its fragment word(s).
template <F32Mma M>
struct MmaOps<float, M> {
  static constexpr int kK = 8;
  using AFrag = Tf32Frag<M, 4>;
  using BFrag = Tf32Frag<M, 2>;

  template <class Tile>
  __device__ __forceinline__ static void load_a(AFrag& a, const Tile& t, int row0, int k0, int lane) {
    uint32_t(&r)[4] = fp32_bits(a);
    ldmatrix_x4(r, t.saddr(row0 + (lane & 15), k0 + (lane >> 4) * 4));
#pragma unroll
    for (int i = 0; i < 4; ++i) tf32_operand(a, i, r[i]);
  }

  template <class Tile>
  __device__ __forceinline__ static void load_b2(BFrag (&b)[2], const Tile& t, int n0, int k0, int lane) {
    uint32_t r[4];
    ldmatrix_x4(r, t.saddr(n0 + (lane & 7) + ((lane >> 4) << 3), k0 + ((lane >> 3) & 1) * 4));
    tf32_operand(b[0], 0, r[0]), tf32_operand(b[0], 1, r[1]), tf32_operand(b[1], 0, r[2]), tf32_operand(b[1], 1, r[3]);
  }

  // The k index of P's A fragment is permuted (see p_to_a): k = t <-> key 2t,
  // k = t + 4 <-> key 2t + 1. B must follow the same permutation.
  template <class Tile>
  __device__ __forceinline__ static void load_bt2(BFrag (&b)[2], const Tile& t, int k0, int n0, int lane) {
    const int key = k0 + 2 * (lane & 3);
    const int col = n0 + (lane >> 2);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      tf32_operand(b[j], 0, t.template at<uint32_t>(key, col + 8 * j));
      tf32_operand(b[j], 1, t.template at<uint32_t>(key + 1, col + 8 * j));
    }
  }

  // k-step kk covers the 8 keys of n-fragment kk. The lane holds keys 2t and
  // 2t + 1; the m16n8k8 A layout wants k = t and t + 4. Since PV sums over
  // keys, relabel instead of shuffling: k = t is key 2t, k = t + 4 is key 2t+1.
  template <int NF>
  __device__ __forceinline__ static void p_to_a(AFrag& a, const float (&s)[NF][4], int kk) {
    tf32_operand(a, 0, __float_as_uint(s[kk][0]));
    tf32_operand(a, 1, __float_as_uint(s[kk][2]));
    tf32_operand(a, 2, __float_as_uint(s[kk][1]));
    tf32_operand(a, 3, __float_as_uint(s[kk][3]));
  }

  __device__ __forceinline__ static void mma(float (&d)[4], const AFrag& a, const BFrag& b) {
    mma_m16n8k8_tf32(d, a, b);
  }
};

// S[MF][NF] = Q rows [row0, row0 + 16 MF) . K^T over the full padded head dim.
// kUnroll: unroll the loop over the head dim, so fragment loads of one k-step
// can be hoisted over the MMAs of the previous one (costs registers).
template <class T, F32Mma M, bool kUnroll, int MF, int NF, class QTile, class KTile>
__device__ __forceinline__ void gemm_qk(float (&s)[MF][NF][4], const QTile& q, const KTile& k, int row0,
                                        int lane) {
  using Ops = MmaOps<T, M>;
  static_assert(NF % 2 == 0, "B fragments come in pairs");
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mf][nf][i] = 0.f;
#pragma unroll(kUnroll ? QTile::kCols / Ops::kK : 1)
  for (int k0 = 0; k0 < QTile::kCols; k0 += Ops::kK) {
    typename Ops::AFrag a[MF];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) Ops::load_a(a[mf], q, row0 + 16 * mf, k0, lane);
#pragma unroll
    for (int nf = 0; nf < NF; nf += 2) {
      typename Ops::BFrag b[2];
      Ops::load_b2(b, k, 8 * nf, k0, lane);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        Ops::mma(s[mf][nf], a[mf], b[0]);
        Ops::mma(s[mf][nf + 1], a[mf], b[1]);
      }
    }
  }
}

// P (probabilities in C fragments) -> the A fragments of the PV product, all
// at once: the fp32 scores die here, so the PV loop has registers to spare for
// prefetching V fragments.
template <class T, F32Mma M, int MF, int NF>
__device__ __forceinline__ void p_fragments(typename MmaOps<T, M>::AFrag (&a)[MF][NF * 8 / MmaOps<T, M>::kK],
                                            const float (&p)[MF][NF][4]) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int kk = 0; kk < NF * 8 / MmaOps<T, M>::kK; ++kk) MmaOps<T, M>::p_to_a(a[mf][kk], p[mf], kk);
}

// O[MF][DF] += P . V, P as A fragments (p_fragments).
template <class T, F32Mma M, int MF, int KK, int DF, class VTile>
__device__ __forceinline__ void gemm_pv(float (&o)[MF][DF][4], const typename MmaOps<T, M>::AFrag (&a)[MF][KK],
                                        const VTile& v, int lane) {
  using Ops = MmaOps<T, M>;
  static_assert(DF % 2 == 0, "B fragments come in pairs");
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
    for (int df = 0; df < DF; df += 2) {
      typename Ops::BFrag b[2];
      Ops::load_bt2(b, v, kk * Ops::kK, 8 * df, lane);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        Ops::mma(o[mf][df], a[mf][kk], b[0]);
        Ops::mma(o[mf][df + 1], a[mf][kk], b[1]);
      }
    }
  }
}

}  // namespace jaxflash::gpu
