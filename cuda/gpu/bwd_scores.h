// P and dS of one (Q tile, K tile) pair, for one warp's block of the S grid:
//   S  = Q K^T (raw),  s2 = (S * scale * log2 e + bias * log2 e - lse2) - lse2_lo
//   P  = exp2(s2)  (0 where masked, and for rows with no gradient: lse2 = +inf)
// With a soft-cap (general variant), S * scale * log2 e becomes c tanh(S * scale *
// log2 e / c), c = log2 e * cap, and dS of Q K^T is dS of the logits times 1 - tanh^2.
// lse2 + lse2_lo is the forward's base-2 lse, exactly (params.h): subtracting the
// large part first keeps s2 exact where P is large, whatever the logits' size.
// float32 only: in 16 bits P and dS are rounded to the input dtype before every
// product, and lo (at most half an ulp of lse2) moves P by less than that below
// logits of ~1e4, so the 16-bit kernels leave it out (it cost them 1-4%, H100).
//   dP = dO V^T,       dS = P o (dP - delta)
// With dropout (keep mask Z, kept entries scaled by c = 1 / (1 - rate)) the
// forward's output used c P o Z: P becomes P o Z (dV's operand; c is applied
// once, to dV) and dP becomes c Z o dO V^T. delta = rowsum(dO o O) holds as it
// is, O being the dropped output.
// Shared by the main kernel and the dbias kernel. Visibility is params.h's
// rule (primitives/bwd_score.h), as in the forward.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "bwd_kernel_traits.h"
#include "primitives/alibi.h"
#include "primitives/bwd_score.h"
#include "primitives/dropout.h"
#include "primitives/warp_gemm.h"
#include "../params.h"

namespace jaxflash::gpu {

// The per-instance operands the scores read (instance origins).
struct ScoreInputs {
  const void* bias;     // T or float (BwdRuntime::bias_f32); null when absent
  const uint8_t* mask;  // null when absent
  const float* lse2;    // workspace rows of this instance
  const float* lse2_lo;
  const float* delta;
  const uint32_t* seed;  // the dropout's seed words; null without dropout
  // Segment ids (BwdConfig::kSegmentIds copies; null otherwise), and whether the current
  // tile pair needs their per-element test (SegmentTiles::needs_test).
  const int32_t* q_ids = nullptr;
  const int32_t* kv_ids = nullptr;
  bool segment_test = false;
  float alibi2 = 0.f;  // ALiBi: log2 e * the instance's slope (general variant; 0 without)
};

// Whether every row of [m0, m0 + BM) below q_len sees every key of [n0, n0 + BN)
// by position (then the position mask is skipped; rows >= q_len have lse2 = +inf,
// so their P is 0 anyway).
template <int BM, int BN>
__device__ __forceinline__ bool tile_pair_full(const AttentionParams& p, const InstanceBounds& b, int64_t m0,
                                               int64_t n0) {
  if (n0 + BN > b.kv_len) return false;
  const int64_t last_row = min(m0 + BM, b.q_len) - 1;
  if (p.window_left != kUnbounded && n0 < last_row + b.offset - p.window_left) return false;
  if (p.window_right != kUnbounded && n0 + BN - 1 > m0 + b.offset + p.window_right) return false;
  return true;
}

// pr <- P, ds <- dS for the warp block at (row0, col0) of the tile pair (m0, n0),
// in fp32. sQ / sdO hold rows m0.., sK / sV keys n0...
// dS is that of Q K^T (what dQ and dK need), or with kDsOfLogits that of the
// logits (dbias's): they differ under a soft-cap, by its slope 1 - tanh^2. In the soft-cap
// copy, with the cap on, logit_rows (when given) <- each fragment row's sum of dS of the
// logits over the warp block's keys, which dscale_share's centre multiplies. In the soft-cap
// copy, on_logit_ds(ds, blk) sees dS of the logits before the slope turns it into dS of Q K^T
// (ALiBi's slope gradient, bwd_dalibi.h, wants the former); the other copies' ds is dS of the
// logits when this returns, and they never call it.
struct NoLogitDs {
  template <class Ds>
  __device__ __forceinline__ void operator()(const Ds&, const ScoreBlock&) const {}
};

template <class Cfg, bool kDsOfLogits = false, class OnLogitDs = NoLogitDs>
__device__ __forceinline__ void probs_and_dscores(float (&pr)[Cfg::kSMF][Cfg::kSNF][4],
                                                  float (&ds)[Cfg::kSMF][Cfg::kSNF][4], const AttentionParams& p,
                                                  const BwdRuntime& rt, const InstanceBounds& b,
                                                  const ScoreInputs& in, int64_t m0, int64_t n0, bool full,
                                                  const typename Cfg::QTile& sQ, const typename Cfg::KTile& sK,
                                                  const typename Cfg::QTile& sdO, const typename Cfg::KTile& sV,
                                                  int row0, int col0, int lane,
                                                  float (*logit_rows)[Cfg::kSMF][2] = nullptr,
                                                  OnLogitDs on_logit_ds = {}) {
  using T = typename Cfg::T;
  constexpr int MF = Cfg::kSMF, NF = Cfg::kSNF, D = Cfg::kHeadDim;

  // Row statistics first: their loads fly during the GEMM.
  constexpr bool kSubtractLo = sizeof(T) == 4;
  float lse2[MF][2], lse2_lo[MF][2] = {}, delta[MF][2];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t t = m0 + row0 + frag_row(mf, 2 * h, lane);
      lse2[mf][h] = __ldg(in.lse2 + t);
      if constexpr (kSubtractLo) lse2_lo[mf][h] = __ldg(in.lse2_lo + t);
      delta[mf][h] = __ldg(in.delta + t);
    }

  zero_frags(pr);
  warp_gemm<T, Cfg::kF32Mma, AOrder::kMK, BOrder::kNK, D>(pr, sQ, row0, sK, col0, lane);

  const ScoreBlock blk(p, b, m0 + row0, n0 + col0);
  // scaled: pr already holds base-2 logits (a soft-cap or a bias made them so).
  bool scaled = false;
  // The soft-cap: in the main kernel's copy for it (BwdConfig::kSoftcap), which keeps
  // each score's slope from here to dS, and in the dbias kernel, which needs no slope;
  // the other copies have none of its code (its registers cost the general one spills).
  constexpr bool kCap = Cfg::kSoftcap || (Cfg::kGeneral && kDsOfLogits);
  constexpr bool kSlope = Cfg::kSoftcap && !kDsOfLogits;
  [[maybe_unused]] float slope[kSlope ? MF : 1][kSlope ? NF : 1][4];
  if constexpr (kCap) {
    if (rt.softcap2 > 0.f) {  // before the bias (params.h)
      scaled = true;
      const float in_mul = rt.score_mul / rt.softcap2;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float t = soft_cap_tanh<T>(pr[mf][nf][i] * in_mul);
            pr[mf][nf][i] = rt.softcap2 * t;
            if constexpr (kSlope) slope[mf][nf][i] = (1.f + t) * (1.f - t);  // as jax's tanh JVP
          }
    }
  }
  if constexpr (Cfg::kGeneral) {
    if (in.bias != nullptr) {
      const float mul = scaled ? 1.f : rt.score_mul;
      scaled = true;
      const ArrayView& v = p.bias;
      auto add = [&](auto unit_col, auto* ptr) {
        bwd_add_bias<decltype(unit_col)::value>(pr, ptr, v.row_stride, v.col_stride, blk, mul, lane);
      };
      if (rt.bias_f32) {
        if (v.col_stride == 1) add(std::true_type{}, static_cast<const float*>(in.bias));
        else add(std::false_type{}, static_cast<const float*>(in.bias));
      } else {
        if (v.col_stride == 1) add(std::true_type{}, static_cast<const T*>(in.bias));
        else add(std::false_type{}, static_cast<const T*>(in.bias));
      }
    }
    // ALiBi, after the soft-cap, with the bias (params.h). Not in the main kernel's copy for
    // segment ids without a soft-cap: its registers would cost every packed-sequence call
    // spills (bf16 D = 128, sm_90a: 0 -> 92 / 236 B); launch_backward_instance runs ALiBi with
    // ids in the soft-cap copy, whose cap is off at run time.
    constexpr bool kAlibi = kDsOfLogits || !Cfg::kSegmentIds || Cfg::kSoftcap;
    if (kAlibi && in.alibi2 != 0.f) {
      const float mul = scaled ? 1.f : rt.score_mul;
      scaled = true;
      alibi_scores(pr, blk.diag, mul, in.alibi2, lane);
    }
  }
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float& x = pr[mf][nf][i];
        x = scaled ? x - lse2[mf][i >> 1] : fmaf(x, rt.score_mul, -lse2[mf][i >> 1]);
        if constexpr (kSubtractLo) x -= lse2_lo[mf][i >> 1];
      }
  if (!full) bwd_mask_positions(pr, blk, lane);
  if constexpr (Cfg::kGeneral) {
    if (in.mask != nullptr) {
      if (p.mask.col_stride == 1) bwd_apply_mask<true>(pr, in.mask, p.mask.row_stride, 1, blk, lane);
      else bwd_apply_mask<false>(pr, in.mask, p.mask.row_stride, p.mask.col_stride, blk, lane);
    }
    if (Cfg::kSegmentIds && in.segment_test)
      bwd_apply_segment_ids(pr, in.q_ids, p.q_segment_ids.row_stride, in.kv_ids, p.kv_segment_ids.row_stride, blk,
                            lane);
  }
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) pr[mf][nf][i] = fast_exp2(pr[mf][nf][i]);  // exp2(-inf) = 0

  zero_frags(ds);
  warp_gemm<T, Cfg::kF32Mma, AOrder::kMK, BOrder::kNK, D>(ds, sdO, row0, sV, col0, lane);
  // P = 0 (masked, or a row without gradient) gives dS = 0 exactly, whatever dP
  // is: an inf in V cannot leak into invisible positions as 0 * inf = NaN.
  auto apply_slope = [&] {  // dS of the logits -> dS of Q K^T
    if constexpr (kSlope) {
      on_logit_ds(ds, blk);
      if (!(rt.softcap2 > 0.f)) return;  // the copy also runs ALiBi with ids, uncapped
      if (logit_rows != nullptr) lane_row_sums(ds, *logit_rows);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int i = 0; i < 4; ++i) ds[mf][nf][i] *= slope[mf][nf][i];
    }
  };
  if constexpr (Cfg::kGeneral) {
    if (in.seed != nullptr) {
      const DropoutKey dropout = make_dropout_key(p, in.seed);
      const FragRowKeys<MF> rows(dropout, m0 + row0, lane);
      for_each_dropout_decision<NF>(dropout, rows, n0 + col0, lane, [&](int mf, int nf, int i, bool keep) {
        const float pv = pr[mf][nf][i];
        const float dp = ds[mf][nf][i] * (keep ? p.keep_scale : 0.f);
        ds[mf][nf][i] = pv != 0.f ? pv * (dp - delta[mf][i >> 1]) : 0.f;
        if (!keep) pr[mf][nf][i] *= 0.f;
      });
      apply_slope();
      return;
    }
  }
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float pv = pr[mf][nf][i];
        ds[mf][nf][i] = pv != 0.f ? pv * (ds[mf][nf][i] - delta[mf][i >> 1]) : 0.f;
      }
  apply_slope();
}

// A traced scale's gradient (kHasDscale, params.h): this lane's share of its warp block's
// Σ dS·(∂logit/∂scale - C) = Σ dS_qk∘(Q Kᵀ) - Σ_rows C·Σ dS, dS that of the logits and dS_qk that of
// Q Kᵀ (the soft-cap's slope times it; equal without a cap), both factors in float32 (dS as
// probs_and_dscores left it, before any rounding to T), C each row's centre (dscale_centre, formed
// by XLA), which keeps the kernel's residue in each row's Σ dS (delta's rounding) from being
// multiplied by the row's mean logit. Exact for any C: each row of dS sums to the lse's cotangent,
// which Python's sum takes back. Q Kᵀ is recomputed into `qk`, P's registers once P is in shared
// memory: kept from probs_and_dscores instead, it would hold a register per score through the dP
// GEMM, where the general variant's registers peak. C is read here from global memory (`centre`:
// the instance's rows), not with delta's row statistics, which would hold its registers through
// both of probs_and_dscores's GEMMs. Rows past T read row T - 1 (their dS is 0). `capped`: the
// soft-cap copy with the cap on, whose ds is dS_qk and whose rows' Σ dS (of the logits) are
// `logit_rows` (probs_and_dscores); elsewhere ds is both.
template <class Cfg>
__device__ __forceinline__ float dscale_share(float (&qk)[Cfg::kSMF][Cfg::kSNF][4],
                                              const float (&ds)[Cfg::kSMF][Cfg::kSNF][4],
                                              const float (&logit_rows)[Cfg::kSMF][2], bool capped,
                                              const AttentionParams& p, const float* centre, int64_t m0,
                                              const typename Cfg::QTile& sQ, const typename Cfg::KTile& sK, int row0,
                                              int col0, int lane) {
  zero_frags(qk);
  warp_gemm<typename Cfg::T, Cfg::kF32Mma, AOrder::kMK, BOrder::kNK, Cfg::kHeadDim>(qk, sQ, row0, sK, col0, lane);
  float share = 0.f;
#pragma unroll
  for (int mf = 0; mf < Cfg::kSMF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t t = min(m0 + row0 + frag_row(mf, 2 * h, lane), p.seqlen_q - 1);
      const float c = __ldg(centre + t * p.dscale_centre.row_stride);
      if (Cfg::kSoftcap && capped) {
        share = fmaf(-c, logit_rows[mf][h], share);
#pragma unroll
        for (int nf = 0; nf < Cfg::kSNF; ++nf)
#pragma unroll
          for (int i = 2 * h; i < 2 * h + 2; ++i) share = fmaf(ds[mf][nf][i], qk[mf][nf][i], share);
      } else {
#pragma unroll
        for (int nf = 0; nf < Cfg::kSNF; ++nf)
#pragma unroll
          for (int i = 2 * h; i < 2 * h + 2; ++i) share = fmaf(ds[mf][nf][i], qk[mf][nf][i] - c, share);
      }
    }
  return share;
}

}  // namespace jaxflash::gpu
