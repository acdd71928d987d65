// The forward's P.V product: P lives in registers (the C fragments of the
// scores) and becomes the A operand directly; V comes from shared memory. Q.K^T
// is a plain warp_gemm (warp_gemm.h), as are all products of the backward.
// float32 has three ways through the tensor cores (F32Mma, ptx.h): tf32, tf32
// with P whole (the differentiated forward), or 3xTF32 for fp32-accurate
// products; PvOps' AFrag / BFrag / mma are one tf32 fragment and one MMA, a
// big/small split of P and two, or big/small splits of both and three.
//
//   S  = Q K^T : A = Q tile [row][dim], B = K tile [key][dim]  (k = dim)
//   O += P V   : A = P (registers),     B = V tile [key][dim]  (k = key)
#pragma once

#include <cstdint>

#include "ptx.h"
#include "smem_tile.h"
#include "warp_gemm.h"

namespace jaxflash::gpu {

// M matters for float only (see F32Mma).
template <class T, F32Mma M = F32Mma::kTf32>
struct PvOps;

// fp16 / bf16: V through the transposing ldmatrix (SmemFrag's kKN B operand).
template <class T>
struct PvOps16 : SmemFrag16<T> {
  template <class Tile>
  __device__ __forceinline__ static typename Tile::Cursor v_cursor(const Tile& v, int lane) {
    return SmemFrag16<T>::template b_cursor<BOrder::kKN>(v, 0, lane);
  }
  // n8 fragments DF0 and DF0 + 1 of V for k step KK (keys 16 KK..).
  template <int KK, int DF0, class Tile>
  __device__ __forceinline__ static void load_v2(uint32_t (&b)[2][2], const Tile& v, const typename Tile::Cursor& c) {
    SmemFrag16<T>::template load_b2<BOrder::kKN, DF0, KK * 16, Tile::chunk_bits(1, 0)>(b[0], b[1], v, c);
  }

  // The value the product takes for a probability x (softmax_finalize).
  __device__ __forceinline__ static float as_operand(float x) { return static_cast<float>(T(x)); }

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
};

template <F32Mma M>
struct PvOps<__half, M> : PvOps16<__half> {};
template <F32Mma M>
struct PvOps<__nv_bfloat16, M> : PvOps16<__nv_bfloat16> {};

// float32: mma.m16n8k8 on tf32 (what JAX's default matmul precision means on
// these GPUs). ldmatrix cannot transpose 32-bit elements, so V is read with
// scalar loads (conflict-free under the swizzle, see smem_tile.h), in the
// permuted k order that P's relabelling (p_to_a) needs. Operands are rounded
// to tf32 rather than left for the hardware to truncate (kTf32), or split into
// big + small tf32 parts (k3xTf32): tf32_operand (ptx.h) turns each raw fp32
// word into its fragment word(s).
//
// The differentiated forward (kTf32WholeP) takes P whole too: big + small tf32 parts, and P.V
// as small P.V + big P.V on tf32 V (one more MMA per k-step). With P rounded, O = sum P~ V
// while the backward's dS = P (dP - delta) takes delta = rowsum(dO O) as sum P dP: the residue
// sum (P~ - P) dP, up to 2^-11 of |dP| a row, went into every dS of the row, and dq (a sum of
// dS K) came out at 2.3x jax.nn's tf32 error on short documents (a row's P a few large values;
// H200, tests/test_sharding.py's segment-id case: 0.0037 -> 0.0021 against a bound of 0.0035).
// The inference forward keeps P rounded: its O is no more accurate with it whole (V's rounding
// sets that), and the extra MMA cost it 16-24% (H200, D = 64 / 128).
template <F32Mma M>
struct PvOps<float, M> : SmemFrag<float, M> {
  static constexpr bool kWholeP = M != F32Mma::kTf32;
  using AFrag = std::conditional_t<kWholeP, Tf32Split<4>, uint32_t[4]>;
  using typename SmemFrag<float, M>::BFrag;

  // The k index of P's A fragment is permuted (see p_to_a): k = t <-> key 2t,
  // k = t + 4 <-> key 2t + 1. B follows the same permutation.
  template <class Tile>
  __device__ __forceinline__ static typename Tile::Cursor v_cursor(const Tile& v, int lane) {
    return v.cursor(2 * (lane & 3), lane >> 2);
  }
  template <int KK, int DF0, class Tile>
  __device__ __forceinline__ static void load_v2(BFrag (&b)[2], const Tile& v, const typename Tile::Cursor& c) {
    constexpr int kBits = Tile::chunk_bits(1, 0);
    tf32_operand(b[0], 0, lds_u32(v.template addr_at<KK * 8, 8 * DF0, kBits>(c)));
    tf32_operand(b[0], 1, lds_u32(v.template addr_at<KK * 8 + 1, 8 * DF0, kBits>(c)));
    tf32_operand(b[1], 0, lds_u32(v.template addr_at<KK * 8, 8 * DF0 + 8, kBits>(c)));
    tf32_operand(b[1], 1, lds_u32(v.template addr_at<KK * 8 + 1, 8 * DF0 + 8, kBits>(c)));
  }
  // The value the product takes for a probability x (softmax_finalize): rounded to tf32, or
  // split into two parts that carry it whole.
  __device__ __forceinline__ static float as_operand(float x) {
    return kWholeP ? x : __uint_as_float(to_tf32(__float_as_uint(x)));
  }

  // O += P V; kTf32WholeP: the small part of P first (smallest first), then the big one.
  __device__ __forceinline__ static void mma(float (&d)[4], const AFrag& a, const BFrag& b) {
    if constexpr (M == F32Mma::kTf32WholeP) {
      mma_m16n8k8_tf32(d, a.small, b);
      mma_m16n8k8_tf32(d, a.big, b);
    } else {
      SmemFrag<float, M>::mma(d, a, b);
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
};


// P (probabilities in C fragments) -> the A fragments of the PV product, all
// at once: the fp32 scores die here, so the PV loop has registers to spare for
// prefetching V fragments.
template <class T, F32Mma M, int MF, int NF>
__device__ __forceinline__ void p_fragments(typename PvOps<T, M>::AFrag (&a)[MF][NF * 8 / PvOps<T, M>::kK],
                                            const float (&p)[MF][NF][4]) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int kk = 0; kk < NF * 8 / PvOps<T, M>::kK; ++kk) PvOps<T, M>::p_to_a(a[mf][kk], p[mf], kk);
}

// O[MF][DF] += P . V, P as A fragments (p_fragments). V is read in pairs of n8
// fragments, (k step, pair) in order, each pair loaded kAhead pairs before its
// MMAs (a ring of kAhead + 1 register sets): the shared-memory latency hides
// behind the MMAs in between, at 4 registers a set (O and P already hold most
// of the file).
template <class T, F32Mma M, int MF, int KK, int DF, class VTile>
__device__ __forceinline__ void gemm_pv(float (&o)[MF][DF][4], const typename PvOps<T, M>::AFrag (&a)[MF][KK],
                                        const VTile& v, int lane) {
  using Ops = PvOps<T, M>;
  static_assert(DF % 2 == 0, "B fragments come in pairs");
  constexpr int kPairs = DF / 2, kUnits = KK * kPairs, kAhead = 2, kRing = kAhead + 1;
  const typename VTile::Cursor cv = Ops::v_cursor(v, lane);
  typename Ops::BFrag b[kRing][2];
  auto load = [&](auto unit) {
    constexpr int u = decltype(unit)::value;
    Ops::template load_v2<u / kPairs, 2 * (u % kPairs)>(b[u % kRing], v, cv);
  };
  static_for<kAhead < kUnits ? kAhead : kUnits>(load);
  static_for<kUnits>([&](auto unit) {
    constexpr int u = decltype(unit)::value, kk = u / kPairs, df = 2 * (u % kPairs);
    if constexpr (u + kAhead < kUnits) load(std::integral_constant<int, u + kAhead>{});
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
      Ops::mma(o[mf][df], a[mf][kk], b[u % kRing][0]);
      Ops::mma(o[mf][df + 1], a[mf][kk], b[u % kRing][1]);
    }
  });
}

}  // namespace jaxflash::gpu
