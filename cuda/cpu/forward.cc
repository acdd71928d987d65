// CPU forward: FlashAttention-2 order. One task per (instance, Q tile); the
// K/V tiles stream through an online softmax with float32 running max, sum and
// output, normalised once at the end. Extra memory is a few tiles per task.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cuda/cpu/kernels.h"
#include "cuda/cpu/tiles.h"

namespace jaxflash::cpu {
namespace {

// A row that sees no key: lse = -inf (hi), 0 (lo).
constexpr LseSplit kEmptyRow{kNegInf, 0.f};

void store_lse(const AttentionParams& p, float* lse, int64_t row, LseSplit value) {
  lse[row * p.lse.row_stride] = value.hi;
  lse[row * p.lse.row_stride + p.lse.col_stride] = value.lo;
}

// OutT is T, or float when the forward writes the backward's float32 residual.
template <class T, class BiasT, class OutT>
JAXFLASH_CPU_TASK
void forward_tile(const AttentionParams& p, const SegmentTileRanges& segments, int64_t inst, int64_t t0) {
  // H: q and k's features, Hv: v and o's; Hp, Hvp: the padded row lengths of their tiles.
  const int64_t H = p.head_dim, Hp = round_up_vec(H);
  const int64_t Hv = p.value_head_dim, Hvp = round_up_vec(Hv);
  const InstanceBounds bounds = instance_bounds(p, inst);
  const int64_t rows = std::min(kBlockQ, p.seqlen_q - t0);

  OutT* o = mutable_element<OutT>(p.o, instance_offset(p, p.o, inst) + t0 * p.o.row_stride);
  float* lse = mutable_element<float>(p.lse, instance_offset(p, p.lse, inst) + t0 * p.lse.row_stride);

  const KeyRange keys = visible_keys(p, bounds, t0, t0 + rows);
  // Rows past q_len are padding; they and rows that see no key output 0.
  const int64_t live_rows = std::clamp<int64_t>(bounds.q_len - t0, 0, rows);
  if (keys.lo >= keys.hi || live_rows == 0) {
    store_zero_rows(rows, Hv, o, p.o.row_stride, p.o.col_stride);
    for (int64_t i = 0; i < rows; ++i) store_lse(p, lse, i, kEmptyRow);
    return;
  }

  std::vector<float> q_tile(kBlockQ * Hp), kt_tile(H * kBlockK), v_tile(kBlockK * Hvp);
  std::vector<float> s_tile(kBlockQ * kBlockK), acc(kBlockQ * Hvp, 0.f);
  std::vector<float> row_offset(kBlockQ, kNegInf), row_sum(kBlockQ, 0.f);

  const T* q = element<T>(p.q, instance_offset(p, p.q, inst) + t0 * p.q.row_stride);
  const T* k = element<T>(p.k, instance_offset(p, p.k, inst));
  const T* v = element<T>(p.v, instance_offset(p, p.v, inst));
  const LogitsInputs<BiasT> logits_in = logits_inputs<BiasT>(p, inst);
  const bool dropout = p.has(kDropout);
  const DropoutKey dropout_in = dropout_key(p, inst);

  // Base-2 logits: fold log2(e) into the scale once, so the softmax is exp2.
  load_tile(q, p.q.row_stride, p.q.col_stride, live_rows, H, instance_scale(p, inst) * kLog2e, q_tile.data(), Hp);
  // P is 2^-p_shift times the probability (params.h, probability_shift). Each row keeps its
  // exp2 offset, running max + p_shift, as the float itself, so that the rescaling between
  // tiles and the lse refer to exactly the offsets the P were taken at (float addition is
  // monotonic: the max of the offsets is the offset of the max).
  const float p_shift = probability_shift(p.seqlen_k);

  for (int64_t s0 = keys.lo; s0 < keys.hi; s0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, keys.hi - s0);
    // Packed sequences: a key tile with none of these rows' segment ids is all masked.
    if (!segments.may_meet(inst, t0, t0 + live_rows, s0, s0 + cols)) continue;
    load_tile_transposed(k + s0 * p.k.row_stride, p.k.row_stride, p.k.col_stride, cols, H,
                         kt_tile.data(), kBlockK);
    load_tile(v + s0 * p.v.row_stride, p.v.row_stride, p.v.col_stride, cols, Hv, 1.f, v_tile.data(), Hvp);

    matmul(q_tile.data(), Hp, kt_tile.data(), kBlockK, live_rows, cols, H, s_tile.data(), kBlockK);
    finish_logits(p, bounds, logits_in, t0, live_rows, s0, cols, s_tile.data(), kBlockK);

    // Online softmax update, row by row.
    for (int64_t i = 0; i < live_rows; ++i) {
      float* s = s_tile.data() + i * kBlockK;
      float tile_max = kNegInf;
      for (int64_t j = 0; j < cols; ++j) tile_max = std::max(tile_max, s[j]);
      const float offset = std::max(row_offset[i], tile_max + p_shift);
      if (offset == kNegInf) {  // nothing visible yet: keep P = 0, avoid (-inf) - (-inf)
        // std::max skips NaN, so a row whose every score is NaN (NaN in q, or in k or bias
        // where nothing else is visible) lands here too: it must end NaN, as in jax.nn, not
        // look like a row with no visible key.
        if (std::any_of(s, s + cols, [](float x) { return x != x; }))
          row_sum[i] = std::numeric_limits<float>::quiet_NaN();
        std::fill(s, s + cols, 0.f);
        continue;
      }
      const float correction = std::exp2(row_offset[i] - offset);  // 0 when it was -inf
      exp2_shifted(s, cols, offset);
      float sum = 0.f;
      for (int64_t j = 0; j < cols; ++j) sum += s[j];
      row_sum[i] = row_sum[i] * correction + sum;
      row_offset[i] = offset;
      // Dropout after the sum: the normaliser (and lse) are the undropped softmax's.
      if (dropout) drop_row(dropout_in, t0 + i, s0, cols, s);
      float* a = acc.data() + i * Hvp;
      for (int64_t d = 0; d < Hv; ++d) a[d] *= correction;
    }
    matmul_acc(s_tile.data(), kBlockK, v_tile.data(), Hvp, live_rows, Hv, cols, acc.data(), Hvp);
  }

  for (int64_t i = 0; i < rows; ++i) {
    const bool empty = i >= live_rows || row_sum[i] == 0.f;
    const float inv = empty ? 0.f : (dropout ? p.keep_scale : 1.f) / row_sum[i];
    store_tile(acc.data() + i * Hvp, Hvp, 1, Hv, inv, o + i * p.o.row_stride, p.o.row_stride, p.o.col_stride);
    store_lse(p, lse, i, empty ? kEmptyRow : split_lse(row_offset[i], std::log2(row_sum[i])));
  }
}

template <class T, class BiasT>
void forward_typed(const AttentionParams& p, const ParallelFor& parallel_for) {
  const int64_t q_tiles = ceil_div(p.seqlen_q, kBlockQ);
  const bool f32_out = p.has(kOutputF32);
  const SegmentTileRanges segments(p);
  parallel_for(p.num_instances() * q_tiles, [&](int64_t task) {
    const int64_t inst = task / q_tiles, t0 = (task % q_tiles) * kBlockQ;
    if (f32_out)
      forward_tile<T, BiasT, float>(p, segments, inst, t0);
    else
      forward_tile<T, BiasT, T>(p, segments, inst, t0);
  });
}

template <class T>
void forward_bias_dispatch(const AttentionParams& p, const ParallelFor& parallel_for) {
  if (p.bias_dtype == DType::kF32)
    forward_typed<T, float>(p, parallel_for);
  else
    forward_typed<T, T>(p, parallel_for);
}

}  // namespace

void forward(const AttentionParams& p, const ParallelFor& parallel_for) {
  switch (p.dtype) {
    case DType::kF32: return forward_typed<float, float>(p, parallel_for);
    case DType::kF16: return forward_bias_dispatch<f16>(p, parallel_for);
    case DType::kBF16: return forward_bias_dispatch<bf16>(p, parallel_for);
  }
}

}  // namespace jaxflash::cpu
