// From raw Q.K^T fragments to the scores the softmax sees: scale and bias
// folded into base-2 units, then positions, the dense mask and the segment ids
// set to -inf.
// Fragment coordinates as in mma.h; a warp's block of scores starts at query
// `row0` and key `col0`.
#pragma once

#include <cmath>
#include <cstdint>

#include "mma.h"
#include "ptx.h"
#include "positions.h"

namespace jaxflash::gpu {

// An operand indexed by (query, key) with arbitrary (possibly 0) strides,
// already offset to its instance.
template <class U>
struct QueryKeyView {
  const U* ptr;
  int64_t row_stride, col_stride;
};

// s = s * mul (the scale, times log2 e).
template <int MF, int NF>
__device__ __forceinline__ void scale_scores(float (&s)[MF][NF][4], float mul) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mf][nf][i] *= mul;
}

// s <- tanh(s mul), T: the inputs' type (soft_cap_tanh): the soft-cap's tanh, whose factor c
// (below) the caller applies, or takes into the exp2's scale (the sm_90 soft-cap copy).
template <class T, int MF, int NF>
__device__ __forceinline__ void tanh_scores(float (&s)[MF][NF][4], float mul) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mf][nf][i] = soft_cap_tanh<T>(s[mf][nf][i] * mul);
}

// The logit soft-cap (params.h) in the scores' base-2 units: s <- c tanh(s mul / c),
// c = log2 e * cap, so that mul (scale * log2 e) turns raw Q.K^T into base-2 logits
// first; T: the inputs' type (soft_cap_tanh).
template <class T, int MF, int NF>
__device__ __forceinline__ void soft_cap_scores(float (&s)[MF][NF][4], float mul, float cap2) {
  tanh_scores<T>(s, mul / cap2);
  scale_scores(s, cap2);
}

// Calls f(mf, nf, i, inside, ptr) for each score element of the warp's block,
// ptr addressing the matching element of a (query, key) operand. `inside` is
// false outside [0, rows) x [0, cols): f must not read there, since those
// elements are invisible anyway (masked, or padding rows the epilogue drops)
// and the operand may end at T x S. The row pointer is formed once per row;
// with a unit column stride (kUnitCol) the column offsets are immediates, so
// the loads need no address registers of their own.
template <bool kUnitCol, int MF, int NF, class U, class F>
__device__ __forceinline__ void for_each_block_element(const QueryKeyView<U>& view, int row0, int col0, int rows,
                                                       int cols, int lane, F&& f) {
  const int64_t col_stride = kUnitCol ? 1 : view.col_stride;
  const U* block = view.ptr + row0 * view.row_stride + (col0 + 2 * (lane & 3)) * col_stride;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
      const U* row = block + r * view.row_stride;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const bool inside = r < rows && frag_col(nf, c, lane) < cols;
          f(mf, nf, 2 * h + c, inside, row + (8 * nf + c) * col_stride);
        }
      }
    }
  }
}

// s = s * mul + bias * log2 e.
template <bool kUnitCol, class BiasT, int MF, int NF>
__device__ __forceinline__ void add_bias(float (&s)[MF][NF][4], const QueryKeyView<BiasT>& bias, int row0, int col0,
                                         const Positions& pos, float mul, int lane) {
  for_each_block_element<kUnitCol, MF, NF>(
      bias, row0, col0, pos.q_len - row0, pos.kv_len - col0, lane,
      [&](int mf, int nf, int i, bool inside, const BiasT* ptr) {
        const float add = inside ? to_float(__ldg(ptr)) : 0.f;
        s[mf][nf][i] = fmaf(add, kLog2e, s[mf][nf][i] * mul);
      });
}

// -inf outside each row's visible key range (see BlockWindow).
template <int MF, int NF>
__device__ __forceinline__ void mask_positions(float (&s)[MF][NF][4], const BlockWindow& w, int lane) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
      const int lo = r + w.lo, hi = r < w.q_end ? min(r + w.hi, w.kv_end) : lo;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = frag_col(nf, c, lane);
          if (col < lo || col >= hi) s[mf][nf][2 * h + c] = -INFINITY;
        }
      }
    }
  }
}

// -inf where the dense mask is 0 (and outside [0, q_len) x [0, kv_len), where
// the mask is not read).
template <bool kUnitCol, int MF, int NF>
__device__ __forceinline__ void apply_mask(float (&s)[MF][NF][4], const QueryKeyView<uint8_t>& mask, int row0,
                                           int col0, const Positions& pos, int lane) {
  for_each_block_element<kUnitCol, MF, NF>(mask, row0, col0, pos.q_len - row0, pos.kv_len - col0, lane,
                                           [&](int mf, int nf, int i, bool inside, const uint8_t* ptr) {
                                             if (!inside || __ldg(ptr) == 0) s[mf][nf][i] = -INFINITY;
                                           });
}

// -inf where the query's and the key's segment ids differ (packed sequences), and
// outside [0, rows) x [0, cols) (q_len, kv_len), where the ids are not read. q_ids
// and kv_ids point at the ids of the block's first row and first column. Key
// ids are loaded where compared (L1 hits after the first row), not held in
// 2 NF registers across the rows (ptxas spilled the same either way at bf16
// D = 256; unmeasured for speed).
template <int MF, int NF>
__device__ __forceinline__ void apply_segment_ids(float (&s)[MF][NF][4], const int32_t* q_ids, int64_t q_stride,
                                                  const int32_t* kv_ids, int64_t kv_stride, int rows, int cols,
                                                  int lane) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
      const bool row_in = r < rows;
      const int32_t query = row_in ? __ldg(q_ids + r * q_stride) : 0;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = frag_col(nf, c, lane);
          if (!row_in || col >= cols || __ldg(kv_ids + col * kv_stride) != query) s[mf][nf][2 * h + c] = -INFINITY;
        }
      }
    }
  }
}

}  // namespace jaxflash::gpu
