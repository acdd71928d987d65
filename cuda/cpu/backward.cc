// CPU backward, FlashAttention-2 algebra in two passes so every output element
// has exactly one writer (deterministic, no atomics):
//
//   P  = exp(logits - lse)          recomputed tile by tile from q, k and lse
//   dV = Pᵀ·dO        dP = dO·Vᵀ    dS = P ∘ (dP - Δ),  Δ = rowsum(dO ∘ O) - dlse (an input)
//   dK = scale·dSᵀ·Q  dQ = scale·dS·K   dbias = dS (summed over broadcast axes)
//   dalibi[s] = -Σ_t dS·(|s - t - offset| - C_t) (ALiBi: the slope's gradient, per key row of each
//                                           query head; C_t = |E_t - t - offset| from the row's
//                                           dalibi_centre E_t: params.h)
//   dscale[s] = Σ_t dS·(∂logit/∂scale - C_t) (a traced scale's gradient, per key row: dS of the
//                                           logits times the soft-cap's slope times q·k, less
//                                           dS times the row's centre C, dscale_centre: params.h)
//
// With dropout (keep mask Z, regenerated from the seed, kept entries scaled by
// c = 1 / (1 - rate)) the output used P∘Z·c, so dV = c·(P∘Z)ᵀ·dO and dP is
// Z∘(dO·Vᵀ)·c; Δ = rowsum(dO ∘ O) is unchanged, O being the dropped output.
//
// Pass A runs K/V tiles outer and owns dK, dV, dscale and dalibi; it loops, inside one task, over
// the instance axes dK/dV do not vary along (the query heads of a GQA group, an
// axis K/V are shared over), and writes each of those instances' rows of dalibi (per query head,
// per key row) after its Q tiles. Pass B runs Q tiles outer and owns dQ and dbias; it
// loops inside one task over the axes dbias is broadcast along (and over all Q
// tiles when the bias has a single row), so those sums need no atomics either.
// Pass B recomputes P and dP; on a CPU that costs less than a T×S buffer.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda/cpu/kernels.h"
#include "cuda/cpu/tiles.h"

namespace jaxflash::cpu {
namespace {

// One Q tile's inputs to the gradient: q (pre-scaled by its instance's scale·log2e), dO, and per
// row the lse in base 2 as two floats (params.h) and Δ (computed by XLA from the float32
// output). With `raw`, also q as it is, for dscale's q·k (from the pre-scaled q it would take a
// division by the scale, which may be 0), and each row's centre C (dscale_centre); with
// `alibi`, each row's centre of dalibi (dalibi_centre).
struct QTile {
  std::vector<float> q, q_raw, d_o, lse_hi, lse_lo, delta, centre, alibi_centre;
  int64_t rows = 0;
  int64_t ld, d_o_ld;  // padded row lengths of q (head_dim) and d_o (value_head_dim)
  QTile(const AttentionParams& p, bool raw, bool alibi)
      : q(kBlockQ * round_up_vec(p.head_dim)), q_raw(raw ? q.size() : 0), d_o(kBlockQ * round_up_vec(p.value_head_dim)),
        lse_hi(kBlockQ), lse_lo(kBlockQ), delta(kBlockQ), centre(raw ? kBlockQ : 0),
        alibi_centre(alibi ? kBlockQ : 0), ld(round_up_vec(p.head_dim)), d_o_ld(round_up_vec(p.value_head_dim)) {}
};

template <class T>
void load_q_tile(const AttentionParams& p, int64_t inst, int64_t t0, int64_t rows, QTile& tile) {
  tile.rows = rows;
  const T* q = element<T>(p.q, instance_offset(p, p.q, inst) + t0 * p.q.row_stride);
  load_tile(q, p.q.row_stride, p.q.col_stride, rows, p.head_dim, instance_scale(p, inst) * kLog2e, tile.q.data(),
            tile.ld);
  if (!tile.q_raw.empty())
    load_tile(q, p.q.row_stride, p.q.col_stride, rows, p.head_dim, 1.f, tile.q_raw.data(), tile.ld);
  const T* d_o = element<T>(p.d_o, instance_offset(p, p.d_o, inst) + t0 * p.d_o.row_stride);
  load_tile(d_o, p.d_o.row_stride, p.d_o.col_stride, rows, p.value_head_dim, 1.f, tile.d_o.data(),
            tile.d_o_ld);
  const float* lse = element<float>(p.lse, instance_offset(p, p.lse, inst) + t0 * p.lse.row_stride);
  const float* delta = element<float>(p.delta, instance_offset(p, p.delta, inst) + t0 * p.delta.row_stride);
  for (int64_t i = 0; i < rows; ++i) {
    tile.lse_hi[i] = lse[i * p.lse.row_stride];
    tile.lse_lo[i] = lse[i * p.lse.row_stride + p.lse.col_stride];
    tile.delta[i] = delta[i * p.delta.row_stride];
  }
  if (!tile.centre.empty()) {
    const float* centre =
        element<float>(p.dscale_centre, instance_offset(p, p.dscale_centre, inst) + t0 * p.dscale_centre.row_stride);
    for (int64_t i = 0; i < rows; ++i) tile.centre[i] = centre[i * p.dscale_centre.row_stride];
  }
  if (!tile.alibi_centre.empty()) {
    const float* centre =
        element<float>(p.dalibi_centre, instance_offset(p, p.dalibi_centre, inst) + t0 * p.dalibi_centre.row_stride);
    for (int64_t i = 0; i < rows; ++i) tile.alibi_centre[i] = centre[i * p.dalibi_centre.row_stride];
  }
}

// From a Q tile and a K/V tile (kt, vt transposed): s ← P (P∘Z with dropout), dp ← dS of the
// logits, and with a soft-cap cap_slope ← the logits' derivative in Q·Kᵀ (finish_logits):
// dS of Q·Kᵀ is dS ∘ cap_slope (apply_cap_slope), dbias takes dS itself.
template <class BiasT>
void probabilities_and_dscores(const AttentionParams& p, const InstanceBounds& bounds,
                               const LogitsInputs<BiasT>& logits_in, const DropoutKey& dropout,
                               const QTile& tile, int64_t t0, int64_t s0, int64_t cols, const float* kt,
                               const float* vt, float* s, float* dp, float* cap_slope) {
  matmul(tile.q.data(), tile.ld, kt, kBlockK, tile.rows, cols, p.head_dim, s, kBlockK);
  finish_logits(p, bounds, logits_in, t0, tile.rows, s0, cols, s, kBlockK, cap_slope);
  matmul(tile.d_o.data(), tile.d_o_ld, vt, kBlockK, tile.rows, cols, p.value_head_dim, dp, kBlockK);
  for (int64_t i = 0; i < tile.rows; ++i) {
    float* si = s + i * kBlockK;
    float* dpi = dp + i * kBlockK;
    // lse = -inf marks a row with no visible key: all its P are 0.
    if (tile.lse_hi[i] == kNegInf)
      std::fill(si, si + cols, 0.f);
    else
      exp2_shifted(si, cols, tile.lse_hi[i], tile.lse_lo[i]);
    if (!p.has(kDropout)) {
      for (int64_t j = 0; j < cols; ++j) dpi[j] = si[j] * (dpi[j] - tile.delta[i]);
      continue;
    }
    // Dropped entries as products with 0, not zeros: a NaN in dP or P reaches dS and dV as
    // in jax.nn's math with dropout (the autodiff of P o Z).
    const uint32_t row_key = dropout.row_key(t0 + i);
    for (int64_t j = 0; j < cols; ++j) {
      const bool keep = dropout.keep(row_key, s0 + j);
      dpi[j] = si[j] * (dpi[j] * (keep ? p.keep_scale : 0.f) - tile.delta[i]);
      si[j] *= keep ? 1.f : 0.f;
    }
  }
}

// dS of the logits -> dS of Q·Kᵀ under a soft-cap (no-op without one).
void apply_cap_slope(const AttentionParams& p, int64_t rows, int64_t cols, const float* cap_slope, float* ds) {
  if (p.softcap == 0.f) return;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) ds[i * kBlockK + j] *= cap_slope[i * kBlockK + j];
}

// Pass A: dK, dV (and dscale) for keys [s0, s0 + kBlockK) of the instances `kept` stands for, and
// each of those instances' rows [s0, s0 + kBlockK) of dalibi.
template <class T, class BiasT>
JAXFLASH_CPU_TASK
void key_tile_gradients(const AttentionParams& p, const SegmentTileRanges& segments, const InstanceSplit& split,
                        int64_t kept, int64_t s0) {
  const int64_t H = p.head_dim, Hp = round_up_vec(H), Hv = p.value_head_dim, Hvp = round_up_vec(Hv);
  const int64_t cols = std::min(kBlockK, p.seqlen_k - s0);
  const bool want_dscale = p.has(kHasDscale);
  std::vector<float> kt(H * kBlockK), vt(Hv * kBlockK), s(kBlockQ * kBlockK), dp(kBlockQ * kBlockK);
  std::vector<float> dk(kBlockK * Hp, 0.f), dv(kBlockK * Hvp, 0.f);
  std::vector<float> cap_slope(p.softcap > 0.f ? kBlockQ * kBlockK : 0);
  std::vector<float> qk(want_dscale ? kBlockQ * kBlockK : 0), dscale(want_dscale ? kBlockK : 0, 0.f);
  const bool want_dalibi = p.has(kHasDalibi);
  float dalibi[kBlockK], distance[kBlockK];
  QTile tile(p, want_dscale, want_dalibi);
  // The instance's rows of dalibi: -Σ_t dS·(distance - C_t) per key, every key of the tile written
  // (0 where no query sees it), so that each element has this one writer.
  auto store_dalibi = [&](int64_t inst) {
    float* out = mutable_element<float>(p.dalibi, instance_offset(p, p.dalibi, inst) + s0 * p.dalibi.row_stride);
    for (int64_t j = 0; j < cols; ++j) out[j * p.dalibi.row_stride] = -dalibi[j];
  };

  const int64_t reduced_count = split.count(true);
  for (int64_t r = 0; r < reduced_count; ++r) {
    const int64_t inst = split.compose(kept, r);
    const InstanceBounds bounds = instance_bounds(p, inst);
    const int64_t live_cols = std::clamp<int64_t>(bounds.kv_len - s0, 0, cols);
    const KeyRange queries = visible_queries(p, bounds, s0, s0 + live_cols);
    if (want_dalibi) std::fill(dalibi, dalibi + kBlockK, 0.f);
    if (live_cols == 0 || queries.lo >= queries.hi) {
      if (want_dalibi) store_dalibi(inst);
      continue;
    }

    load_tile_transposed(element<T>(p.k, instance_offset(p, p.k, inst) + s0 * p.k.row_stride),
                         p.k.row_stride, p.k.col_stride, live_cols, H, kt.data(), kBlockK);
    load_tile_transposed(element<T>(p.v, instance_offset(p, p.v, inst) + s0 * p.v.row_stride),
                         p.v.row_stride, p.v.col_stride, live_cols, Hv, vt.data(), kBlockK);
    const LogitsInputs<BiasT> logits_in = logits_inputs<BiasT>(p, inst);
    const DropoutKey dropout = dropout_key(p, inst);

    for (int64_t t0 = queries.lo; t0 < queries.hi; t0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, queries.hi - t0);
      if (!segments.may_meet(inst, t0, t0 + rows, s0, s0 + live_cols)) continue;  // packed sequences
      load_q_tile<T>(p, inst, t0, rows, tile);
      probabilities_and_dscores(p, bounds, logits_in, dropout, tile, t0, s0, live_cols, kt.data(),
                                vt.data(), s.data(), dp.data(), cap_slope.data());
      if (want_dscale) {  // Σ_t dS·(slope·q·k - C_t), dS of the logits, in float32 (params.h, dscale)
        matmul(tile.q_raw.data(), tile.ld, kt.data(), kBlockK, tile.rows, live_cols, H, qk.data(), kBlockK);
        const bool capped = p.softcap > 0.f;
        for (int64_t i = 0; i < tile.rows; ++i)
          for (int64_t j = 0; j < live_cols; ++j) {
            const int64_t e = i * kBlockK + j;
            dscale[j] += dp[e] * ((capped ? cap_slope[e] * qk[e] : qk[e]) - tile.centre[i]);
          }
      }
      if (want_dalibi) {  // dS of the logits, as dbias takes it: ALiBi is added after the cap
        for (int64_t i = 0; i < tile.rows; ++i) {
          alibi_distances(bounds, t0 + i, s0, live_cols, distance);
          const float* dsi = dp.data() + i * kBlockK;
          // The row's centre |E_t - (t + offset)| (params.h, dalibi_centre), t + offset exact.
          const float c = std::fabs(tile.alibi_centre[i] - static_cast<float>(t0 + i + bounds.offset));
          for (int64_t j = 0; j < live_cols; ++j) dalibi[j] += dsi[j] * (distance[j] - c);
        }
      }
      apply_cap_slope(p, tile.rows, live_cols, cap_slope.data(), dp.data());
      matmul_tn_acc(s.data(), kBlockK, tile.d_o.data(), Hvp, tile.rows, Hv, live_cols, dv.data(), Hvp);
      matmul_tn_acc(dp.data(), kBlockK, tile.q.data(), Hp, tile.rows, H, live_cols, dk.data(), Hp);
    }
    if (want_dalibi) store_dalibi(inst);
  }
  // kept's own instance has index 0 on the reduced axes, where dk/dv strides are 0.
  const int64_t inst = split.compose(kept, 0);
  // q was pre-scaled by scale·log2e; dK wants scale alone.
  store_tile(dk.data(), Hp, cols, H, kLn2,
             mutable_element<T>(p.dk, instance_offset(p, p.dk, inst) + s0 * p.dk.row_stride),
             p.dk.row_stride, p.dk.col_stride);
  store_tile(dv.data(), Hvp, cols, Hv, p.has(kDropout) ? p.keep_scale : 1.f,
             mutable_element<T>(p.dv, instance_offset(p, p.dv, inst) + s0 * p.dv.row_stride),
             p.dv.row_stride, p.dv.col_stride);
  if (want_dscale) {
    float* out = mutable_element<float>(p.dscale, instance_offset(p, p.dscale, inst) + s0 * p.dscale.row_stride);
    for (int64_t j = 0; j < cols; ++j) out[j * p.dscale.row_stride] = dscale[j];
  }
}

// Pass B: dQ for the Q tiles of one task and their share of dbias.
template <class T, class BiasT>
JAXFLASH_CPU_TASK
void query_tile_gradients(const AttentionParams& p, const SegmentTileRanges& segments, const InstanceSplit& split,
                          int64_t kept, int64_t first_t0, int64_t last_t0) {
  const int64_t H = p.head_dim, Hp = round_up_vec(H), S = p.seqlen_k;
  const bool want_dbias = p.has(kHasDbias);
  // A bias with one row (or one column) gets the sum of dS over rows (columns).
  const bool dbias_one_row = p.seqlen_q > 1 && p.dbias.row_stride == 0;
  const bool dbias_one_col = S > 1 && p.dbias.col_stride == 0;
  const int64_t dbias_rows = dbias_one_row ? 1 : kBlockQ;
  const int64_t dbias_cols = dbias_one_col ? 1 : S;
  std::vector<float> dbias(want_dbias ? dbias_rows * dbias_cols : 0, 0.f);

  std::vector<float> kt(H * kBlockK), vt(p.value_head_dim * kBlockK), k(kBlockK * Hp);
  std::vector<float> s(kBlockQ * kBlockK), ds(kBlockQ * kBlockK), dq(kBlockQ * Hp);
  std::vector<float> cap_slope(p.softcap > 0.f ? kBlockQ * kBlockK : 0);
  QTile tile(p, false, false);

  const int64_t reduced_count = split.count(true);
  for (int64_t r = 0; r < reduced_count; ++r) {
    const int64_t inst = split.compose(kept, r);
    const InstanceBounds bounds = instance_bounds(p, inst);
    const LogitsInputs<BiasT> logits_in = logits_inputs<BiasT>(p, inst);
    const DropoutKey dropout = dropout_key(p, inst);
    const T* k_base = element<T>(p.k, instance_offset(p, p.k, inst));
    const T* v_base = element<T>(p.v, instance_offset(p, p.v, inst));

    for (int64_t t0 = first_t0; t0 <= last_t0; t0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, p.seqlen_q - t0);
      const int64_t live_rows = std::clamp<int64_t>(bounds.q_len - t0, 0, rows);
      const KeyRange keys = visible_keys(p, bounds, t0, t0 + rows);
      std::fill(dq.begin(), dq.end(), 0.f);
      if (live_rows > 0 && keys.lo < keys.hi) {
        load_q_tile<T>(p, inst, t0, live_rows, tile);
        for (int64_t s0 = keys.lo; s0 < keys.hi; s0 += kBlockK) {
          const int64_t cols = std::min(kBlockK, keys.hi - s0);
          if (!segments.may_meet(inst, t0, t0 + live_rows, s0, s0 + cols)) continue;  // packed sequences
          load_tile_transposed(k_base + s0 * p.k.row_stride, p.k.row_stride, p.k.col_stride, cols, H,
                               kt.data(), kBlockK);
          load_tile(k_base + s0 * p.k.row_stride, p.k.row_stride, p.k.col_stride, cols, H, 1.f, k.data(), Hp);
          load_tile_transposed(v_base + s0 * p.v.row_stride, p.v.row_stride, p.v.col_stride, cols,
                               p.value_head_dim, vt.data(), kBlockK);
          probabilities_and_dscores(p, bounds, logits_in, dropout, tile, t0, s0, cols, kt.data(),
                                    vt.data(), s.data(), ds.data(), cap_slope.data());
          if (want_dbias) {
            for (int64_t i = 0; i < live_rows; ++i) {
              float* row = dbias.data() + (dbias_one_row ? 0 : i) * dbias_cols;
              const float* dsi = ds.data() + i * kBlockK;
              for (int64_t j = 0; j < cols; ++j) row[dbias_one_col ? 0 : s0 + j] += dsi[j];
            }
          }
          apply_cap_slope(p, live_rows, cols, cap_slope.data(), ds.data());
          matmul_acc(ds.data(), kBlockK, k.data(), Hp, live_rows, H, cols, dq.data(), Hp);
        }
      }
      const int64_t dq_offset = instance_offset(p, p.dq, inst) + t0 * p.dq.row_stride;
      if (p.has(kScaleOperand))  // the scaled query's dq, in float32 (params.h)
        store_tile(dq.data(), Hp, rows, H, 1.f, mutable_element<float>(p.dq, dq_offset), p.dq.row_stride,
                   p.dq.col_stride);
      else
        store_tile(dq.data(), Hp, rows, H, p.scale, mutable_element<T>(p.dq, dq_offset), p.dq.row_stride,
                   p.dq.col_stride);
    }
  }
  if (!want_dbias) return;
  const int64_t inst = split.compose(kept, 0);
  const int64_t out_rows = dbias_one_row ? 1 : std::min(kBlockQ, p.seqlen_q - first_t0);
  BiasT* out = mutable_element<BiasT>(p.dbias, instance_offset(p, p.dbias, inst) +
                                                  (dbias_one_row ? 0 : first_t0) * p.dbias.row_stride);
  store_tile(dbias.data(), dbias_cols, out_rows, dbias_cols, 1.f, out, p.dbias.row_stride,
             p.dbias.col_stride);
}

template <class T, class BiasT>
void backward_typed(const AttentionParams& p, const ParallelFor& parallel_for) {
  const InstanceSplit kv_split{&p, broadcast_axes(p, p.dk)};
  const int64_t k_tiles = ceil_div(p.seqlen_k, kBlockK);
  const SegmentTileRanges segments(p);
  parallel_for(kv_split.count(false) * k_tiles, [&](int64_t task) {
    key_tile_gradients<T, BiasT>(p, segments, kv_split, task / k_tiles, (task % k_tiles) * kBlockK);
  });

  const bool want_dbias = p.has(kHasDbias);
  const InstanceSplit q_split{&p, want_dbias ? broadcast_axes(p, p.dbias) : 0u};
  const int64_t q_tiles = ceil_div(p.seqlen_q, kBlockQ);
  const int64_t last_t0 = (q_tiles - 1) * kBlockQ;
  if (want_dbias && p.seqlen_q > 1 && p.dbias.row_stride == 0) {
    // A one-row dbias sums over every Q tile: one task walks them all.
    parallel_for(q_split.count(false), [&](int64_t task) {
      query_tile_gradients<T, BiasT>(p, segments, q_split, task, 0, last_t0);
    });
  } else {
    parallel_for(q_split.count(false) * q_tiles, [&](int64_t task) {
      const int64_t t0 = (task % q_tiles) * kBlockQ;
      query_tile_gradients<T, BiasT>(p, segments, q_split, task / q_tiles, t0, t0);
    });
  }
}

template <class T>
void backward_bias_dispatch(const AttentionParams& p, const ParallelFor& parallel_for) {
  if (p.bias_dtype == DType::kF32)
    backward_typed<T, float>(p, parallel_for);
  else
    backward_typed<T, T>(p, parallel_for);
}

}  // namespace

void backward(const AttentionParams& p, const ParallelFor& parallel_for) {
  switch (p.dtype) {
    case DType::kF32: return backward_typed<float, float>(p, parallel_for);
    case DType::kF16: return backward_bias_dispatch<f16>(p, parallel_for);
    case DType::kBF16: return backward_bias_dispatch<bf16>(p, parallel_for);
  }
}

}  // namespace jaxflash::cpu
