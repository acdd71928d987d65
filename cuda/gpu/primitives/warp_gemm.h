// Fragment loads from shared-memory tiles and the generic warp GEMM, on top of
// ptx.h / smem_tile.h: every product of the backward and the forward's Q K^T.
// The backward multiplies tiles in every orientation (dV = P^T dO reads P
// transposed, dQ = dS K reads K as [k][n]), so both operands come in both
// storage orders:
//
//   A (m x k):  kMK: the tile is stored [m][k]    kKM: the tile is stored [k][m]
//   B (k x n):  kNK: the tile is stored [n][k]    kKN: the tile is stored [k][n]
//
// The k order inside a fragment is the natural one for every type (the
// forward's fp32 P.V path permutes k, which only works with P in registers:
// mma.h). float32 runs in either F32Mma mode (ptx.h), through SmemFrag's
// AFrag / BFrag / mma: warp_gemm is written once for all of them.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

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

// The m16n8 fp32 accumulator ("C fragment") of every MMA here: lane l = 4g + t
// holds rows g and g + 8, columns 2t and 2t + 1, as
//   c[0] = (g, 2t)   c[1] = (g, 2t + 1)   c[2] = (g + 8, 2t)   c[3] = (g + 8, 2t + 1)
// so softmax, masking and the epilogues are written once against that layout.
// Coordinates of element i (0..3) of m-fragment mf / n-fragment nf, relative
// to the warp block:
__device__ __forceinline__ int frag_row(int mf, int i, int lane) { return 16 * mf + (lane >> 2) + 8 * (i >> 1); }
__device__ __forceinline__ int frag_col(int nf, int i, int lane) { return 8 * nf + 2 * (lane & 3) + (i & 1); }

// Four n-fragments' words of one row (x[j]: fragment j's columns 2t, 2t + 1 as
// a 16-bit pair, t = lane % 4) regrouped within the quad, a 4 x 4 transpose by
// XOR shuffles: lane t gets fragment t's 8 columns, words from quad lanes
// 0..3, for one 16-byte store; the quad's four stores cover the fragments' 32
// contiguous columns (64 bytes) where the pairs took eight 16-byte pieces of
// eight rows per instruction. Every lane of the warp calls it.
__device__ __forceinline__ uint4 quad_transpose(const uint32_t (&x)[4], int lane) {
  const int t = lane & 3;
  uint32_t y[4] = {};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int j = t ^ s;  // the partner's fragment: it sends this lane's word of fragment t
    const uint32_t in = __shfl_xor_sync(0xffffffffu, j == 0 ? x[0] : j == 1 ? x[1] : j == 2 ? x[2] : x[3], s);
#pragma unroll
    for (int k = 0; k < 4; ++k) y[k] = k == j ? in : y[k];
  }
  return make_uint4(y[0], y[1], y[2], y[3]);
}

enum class AOrder { kMK, kKM };
enum class BOrder { kNK, kKN };

// M matters for float only (see F32Mma).
template <class T, F32Mma M = F32Mma::kTf32>
struct SmemFrag;

// Every load takes its tile's per-lane Cursor (smem_tile.h) and compile-time
// offsets from it: (MI, K0) for an A fragment (rows m0 + 16 MI of the warp
// block, k from K0), (NI, K0) for B (columns n0 + 8 NI). The cursors come from
// a_cursor / b_cursor at the warp block's origin (m0, n0); kABits / kBBits
// are the swizzle bits their chunk index can have (SmemTile::chunk_bits), for
// a warp block of MF m16 x NF n8 fragments whose origin is a multiple of it.
//
// fp16 / bf16, mma.m16n8k16. A: a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..),
// a3 (g+8, 2t+8..); B: b0 (k 2t.., n g), b1 (k 2t+8.., n g). Everything
// through ldmatrix, transposing where the tile is stored the other way.
template <class T>
struct SmemFrag16 {
  static constexpr int kK = 16;
  using AFrag = uint32_t[4];  // the registers of one operand fragment
  using BFrag = uint32_t[2];

  // kMK: matrix i = lane / 8 holds (m 8(i&1).., k 8(i>>1)..), rows m.
  // kKM: the same matrices stored as rows k, read transposed.
  template <AOrder O, class Tile>
  __device__ __forceinline__ static typename Tile::Cursor a_cursor(const Tile& t, int m0, int lane) {
    if constexpr (O == AOrder::kMK) return t.cursor(m0 + (lane & 15), (lane >> 4) * 8);
    else return t.cursor((lane & 7) + (lane >> 4) * 8, m0 + ((lane >> 3) & 1) * 8);
  }
  template <AOrder O, class Tile, int MF>
  static constexpr int kABits = O == AOrder::kMK ? Tile::chunk_bits(1, 0) : Tile::chunk_bits(1, 16 * MF);

  template <AOrder O, int MI, int K0, int kBits, class Tile>
  __device__ __forceinline__ static void load_a(uint32_t (&a)[4], const Tile& t, const typename Tile::Cursor& c) {
    if constexpr (O == AOrder::kMK) ldmatrix_x4(a, t.template addr_at<16 * MI, K0, kBits>(c));
    else ldmatrix_x4_trans(a, t.template addr_at<K0, 16 * MI, kBits>(c));
  }

  // B in pairs of n8 fragments: matrices (n 0.., k 0..), (n 0.., k 8..),
  // (n 8.., k 0..), (n 8.., k 8..). kNK: rows n; kKN: rows k, read transposed.
  template <BOrder O, class Tile>
  __device__ __forceinline__ static typename Tile::Cursor b_cursor(const Tile& t, int n0, int lane) {
    if constexpr (O == BOrder::kNK) return t.cursor(n0 + (lane & 7) + ((lane >> 4) << 3), ((lane >> 3) & 1) * 8);
    else return t.cursor((lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8);
  }
  template <BOrder O, class Tile, int NF>
  static constexpr int kBBits = O == BOrder::kNK ? Tile::chunk_bits(1, 0) : Tile::chunk_bits(1, 8 * NF);

  // Fragments NI and NI + 1.
  template <BOrder O, int NI, int K0, int kBits, class Tile>
  __device__ __forceinline__ static void load_b2(uint32_t (&b0)[2], uint32_t (&b1)[2], const Tile& t,
                                                 const typename Tile::Cursor& c) {
    uint32_t r[4];
    if constexpr (O == BOrder::kNK) ldmatrix_x4(r, t.template addr_at<8 * NI, K0, kBits>(c));
    else ldmatrix_x4_trans(r, t.template addr_at<K0, 8 * NI, kBits>(c));
    b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
  }

  // Fragment NI alone: the first two matrices of the pair's addresses (lanes
  // 16..31 pass addresses too; ldmatrix .x2 ignores them).
  template <BOrder O, int NI, int K0, int kBits, class Tile>
  __device__ __forceinline__ static void load_b1(uint32_t (&b)[2], const Tile& t, const typename Tile::Cursor& c) {
    if constexpr (O == BOrder::kNK) ldmatrix_x2(b, t.template addr_at<8 * NI, K0, kBits>(c));
    else ldmatrix_x2_trans(b, t.template addr_at<K0, 8 * NI, kBits>(c));
  }

  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    mma_m16n8k16(d, a, b, T{});
  }
};

template <F32Mma M>
struct SmemFrag<__half, M> : SmemFrag16<__half> {};
template <F32Mma M>
struct SmemFrag<__nv_bfloat16, M> : SmemFrag16<__nv_bfloat16> {};

// fp32 on tf32 mma.m16n8k8. A: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
// B: b0 (k t, n g), b1 (k t+4, n g). A 16-byte chunk is 4 floats, so ldmatrix's
// 8x8 b16 matrix is an 8x4 fp32 one with lane l at (l/4, l%4): the
// non-transposed orders load with ldmatrix, the transposed ones with scalar
// loads at (k t.., m / n g..) (ldmatrix cannot transpose 32-bit elements).
// Operands are rounded to tf32 (cvt.rna) on the way, or split into big + small
// tf32 parts (k3xTf32): tf32_operand (ptx.h) turns each raw fp32 word into its
// fragment word(s).
template <F32Mma M>
struct SmemFrag<float, M> {
  static constexpr int kK = 8;
  using AFrag = Tf32Frag<M, 4>;
  using BFrag = Tf32Frag<M, 2>;

  // A transposed (k-major) tile's words (K0 + t, COL + g) and (K0 + t + 4, COL + g)
  // for the cursor at (t, g): the two k halves of one fragment column.
  template <int K0, int COL, int kBits, class Tile>
  __device__ __forceinline__ static void load_k_pair(uint32_t& lo, uint32_t& hi, const Tile& t,
                                                     const typename Tile::Cursor& c) {
    lo = lds_u32(t.template addr_at<K0, COL, kBits>(c));
    hi = lds_u32(t.template addr_at<K0 + 4, COL, kBits>(c));
  }

  template <AOrder O, class Tile>
  __device__ __forceinline__ static typename Tile::Cursor a_cursor(const Tile& t, int m0, int lane) {
    if constexpr (O == AOrder::kMK) return t.cursor(m0 + (lane & 15), (lane >> 4) * 4);
    else return t.cursor(lane & 3, m0 + (lane >> 2));
  }
  template <AOrder O, class Tile, int MF>
  static constexpr int kABits = O == AOrder::kMK ? Tile::chunk_bits(1, 0) : Tile::chunk_bits(1, 16 * MF);

  template <AOrder O, int MI, int K0, int kBits, class Tile>
  __device__ __forceinline__ static void load_a(AFrag& a, const Tile& t, const typename Tile::Cursor& c) {
    uint32_t(&r)[4] = fp32_bits(a);
    if constexpr (O == AOrder::kMK) {
      ldmatrix_x4(r, t.template addr_at<16 * MI, K0, kBits>(c));
    } else {
      load_k_pair<K0, 16 * MI, kBits>(r[0], r[2], t, c);
      load_k_pair<K0, 16 * MI + 8, kBits>(r[1], r[3], t, c);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) tf32_operand(a, i, r[i]);
  }

  template <BOrder O, class Tile>
  __device__ __forceinline__ static typename Tile::Cursor b_cursor(const Tile& t, int n0, int lane) {
    if constexpr (O == BOrder::kNK) return t.cursor(n0 + (lane & 7) + ((lane >> 4) << 3), ((lane >> 3) & 1) * 4);
    else return t.cursor(lane & 3, n0 + (lane >> 2));
  }
  template <BOrder O, class Tile, int NF>
  static constexpr int kBBits = O == BOrder::kNK ? Tile::chunk_bits(1, 0) : Tile::chunk_bits(1, 8 * NF);

  template <BOrder O, int NI, int K0, int kBits, class Tile>
  __device__ __forceinline__ static void load_b2(BFrag& b0, BFrag& b1, const Tile& t,
                                                 const typename Tile::Cursor& c) {
    uint32_t(&r0)[2] = fp32_bits(b0);
    uint32_t(&r1)[2] = fp32_bits(b1);
    if constexpr (O == BOrder::kNK) {
      uint32_t x[4];
      ldmatrix_x4(x, t.template addr_at<8 * NI, K0, kBits>(c));
      r0[0] = x[0], r0[1] = x[1], r1[0] = x[2], r1[1] = x[3];
    } else {
      load_k_pair<K0, 8 * NI, kBits>(r0[0], r0[1], t, c);
      load_k_pair<K0, 8 * NI + 8, kBits>(r1[0], r1[1], t, c);
    }
    tf32_operand(b0, 0, r0[0]), tf32_operand(b0, 1, r0[1]);
    tf32_operand(b1, 0, r1[0]), tf32_operand(b1, 1, r1[1]);
  }

  template <BOrder O, int NI, int K0, int kBits, class Tile>
  __device__ __forceinline__ static void load_b1(BFrag& b, const Tile& t, const typename Tile::Cursor& c) {
    uint32_t(&r)[2] = fp32_bits(b);
    if constexpr (O == BOrder::kNK) {
      ldmatrix_x2(r, t.template addr_at<8 * NI, K0, kBits>(c));
    } else {
      load_k_pair<K0, 8 * NI, kBits>(r[0], r[1], t, c);
    }
    tf32_operand(b, 0, r[0]), tf32_operand(b, 1, r[1]);
  }

  __device__ __forceinline__ static void mma(float (&d)[4], const AFrag& a, const BFrag& b) {
    mma_m16n8k8_tf32(d, a, b);
  }
};

// Calls f(std::integral_constant<int, 0>{}) ... f(<N - 1>): a loop whose
// index is a compile-time constant in the body (template offsets).
template <class F, int... I>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

// C[MF][NF] += A . B for the warp block whose first row is m0 (of A's m) and
// first column n0 (of B's n), reducing over k in [0, KDIM). m0 must be a
// multiple of 16 MF and n0 of 8 NF (the warp grids' origins are). M: the
// float32 MMA mode (ignored for 16-bit T).
//
// Fully unrolled and software-pipelined: the fragments of k step s + 1 are
// loaded (into the other of two register sets) before the MMAs of step s
// issue, so the shared-memory latency hides behind a step of tensor-core work
// instead of stalling each step; with 8 warps per SM there are too few other
// warps to hide it. Every address is a cursor plus a compile-time offset.
template <class T, F32Mma M, AOrder AO, BOrder BO, int KDIM, int MF, int NF, class ATile, class BTile>
__device__ __forceinline__ void warp_gemm(float (&c)[MF][NF][4], const ATile& a, int m0, const BTile& b, int n0,
                                          int lane) {
  using F = SmemFrag<T, M>;
  constexpr int kSteps = KDIM / F::kK;
  static_assert(KDIM % F::kK == 0, "whole k steps");
  constexpr int kABits = F::template kABits<AO, ATile, MF>;
  constexpr int kBBits = F::template kBBits<BO, BTile, NF>;
  const typename ATile::Cursor ca = F::template a_cursor<AO>(a, m0, lane);
  const typename BTile::Cursor cb = F::template b_cursor<BO>(b, n0, lane);
  typename F::AFrag af[2][MF];
  typename F::BFrag bf[2][NF];
  auto load_step = [&](auto step) {
    constexpr int s = decltype(step)::value, k0 = s * F::kK, buf = s & 1;
    static_for<MF>([&](auto mi) { F::template load_a<AO, mi.value, k0, kABits>(af[buf][mi.value], a, ca); });
    static_for<NF / 2>([&](auto j) {
      constexpr int ni = 2 * j.value;
      F::template load_b2<BO, ni, k0, kBBits>(bf[buf][ni], bf[buf][ni + 1], b, cb);
    });
    if constexpr (NF % 2 == 1) F::template load_b1<BO, NF - 1, k0, kBBits>(bf[buf][NF - 1], b, cb);
  };
  load_step(std::integral_constant<int, 0>{});
  static_for<kSteps>([&](auto step) {
    constexpr int s = decltype(step)::value;
    if constexpr (s + 1 < kSteps) load_step(std::integral_constant<int, s + 1>{});
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) F::mma(c[mf][nf], af[s & 1][mf], bf[s & 1][nf]);
  });
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

// The lane's share of each of its rows' sums over a C-fragment block: rows[mf][h]
// for row 16 mf + 8 h + lane / 4, over the lane's columns (its quad's other three
// lanes hold the rest of the row).
template <int MF, int NF>
__device__ __forceinline__ void lane_row_sums(const float (&c)[MF][NF][4], float (&rows)[MF][2]) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x = 0.f;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) x += c[mf][nf][2 * h] + c[mf][nf][2 * h + 1];
      rows[mf][h] = x;
    }
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

}  // namespace jaxflash::gpu
