// The logits epilogue of the backward on C fragments: bias, position mask
// (lengths, causal / window), dense mask and segment ids, with params.h's
// visibility rule.
// Same semantics as the forward's score.h, kept separate so the backward does
// not follow that file's changes. Positions are 64-bit per block, then 32-bit
// relative to the block (clipped far outside it), so no sequence-length limit.
#pragma once

#include <cmath>
#include <cstdint>

#include "warp_gemm.h"
#include "ptx.h"
#include "../../params.h"

namespace jaxflash::gpu {

// A block of the score tile: query rows [row0, ...) and keys [col0, ...), and
// its visible region relative to it: row r sees columns [r + lo, r + hi)
// clipped to [0, kv_end), none when r >= q_end. diag: the column of row 0's diagonal
// (ALiBi's distances; exact, CUDA positions stay below 2^28).
struct ScoreBlock {
  int64_t row0, col0;
  int lo, hi, kv_end, q_end, diag;

  __device__ __forceinline__ static int clip(int64_t x) {
    constexpr int64_t kFar = int64_t{1} << 24;  // beyond any block coordinate
    return static_cast<int>(x < -kFar ? -kFar : (x > kFar ? kFar : x));
  }
  __device__ __forceinline__ ScoreBlock(const AttentionParams& p, const InstanceBounds& b, int64_t row0_,
                                        int64_t col0_)
      : row0(row0_), col0(col0_) {
    const int64_t diag64 = row0 + b.offset - col0;
    lo = p.window_left == kUnbounded ? -(1 << 24) : clip(diag64 - p.window_left);
    hi = p.window_right == kUnbounded ? (1 << 24) : clip(diag64 + p.window_right + 1);
    kv_end = clip(b.kv_len - col0);
    q_end = clip(b.q_len - row0);
    diag = static_cast<int>(diag64);
  }
};

// -inf outside each row's visible key range.
template <int MF, int NF>
__device__ __forceinline__ void bwd_mask_positions(float (&s)[MF][NF][4], const ScoreBlock& blk, int lane) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
      const int lo = r + blk.lo, hi = r < blk.q_end ? min(r + blk.hi, blk.kv_end) : lo;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = frag_col(nf, c, lane);
          if (col < lo || col >= hi) s[mf][nf][2 * h + c] = -INFINITY;
        }
    }
}

// f(mf, nf, i, inside, ptr) for every element of the block of a (query, key)
// operand `base` (instance origin); inside = within [0, q_len) x [0, kv_len),
// where alone the operand may be read.
template <bool kUnitCol, int MF, int NF, class U, class F>
__device__ __forceinline__ void bwd_for_each_element(const U* base, int64_t row_stride, int64_t col_stride,
                                                     const ScoreBlock& blk, int lane, F&& f) {
  const int64_t cs = kUnitCol ? 1 : col_stride;
  const U* block = base + blk.row0 * row_stride + (blk.col0 + 2 * (lane & 3)) * cs;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
      const U* row = block + r * row_stride;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const bool inside = r < blk.q_end && frag_col(nf, c, lane) < blk.kv_end;
          f(mf, nf, 2 * h + c, inside, row + (8 * nf + c) * cs);
        }
    }
}

// s = s * mul + bias * log2 e.
template <bool kUnitCol, class BiasT, int MF, int NF>
__device__ __forceinline__ void bwd_add_bias(float (&s)[MF][NF][4], const BiasT* bias, int64_t row_stride,
                                             int64_t col_stride, const ScoreBlock& blk, float mul, int lane) {
  bwd_for_each_element<kUnitCol, MF, NF>(bias, row_stride, col_stride, blk, lane,
                                         [&](int mf, int nf, int i, bool inside, const BiasT* ptr) {
                                           const float add = inside ? to_float(__ldg(ptr)) : 0.f;
                                           s[mf][nf][i] = fmaf(add, kLog2e, s[mf][nf][i] * mul);
                                         });
}

// -inf where the dense mask is 0 or outside [0, q_len) x [0, kv_len).
template <bool kUnitCol, int MF, int NF>
__device__ __forceinline__ void bwd_apply_mask(float (&s)[MF][NF][4], const uint8_t* mask, int64_t row_stride,
                                               int64_t col_stride, const ScoreBlock& blk, int lane) {
  bwd_for_each_element<kUnitCol, MF, NF>(mask, row_stride, col_stride, blk, lane,
                                         [&](int mf, int nf, int i, bool inside, const uint8_t* ptr) {
                                           if (!inside || __ldg(ptr) == 0) s[mf][nf][i] = -INFINITY;
                                         });
}

// -inf where the query's and the key's segment ids differ (packed sequences) or
// outside [0, q_len) x [0, kv_len), where the ids are not read. q_ids / kv_ids:
// the instance's ids (origins). Key ids are loaded where compared (L1 hits
// after the first row), as in the forward's apply_segment_ids.
template <int MF, int NF>
__device__ __forceinline__ void bwd_apply_segment_ids(float (&s)[MF][NF][4], const int32_t* q_ids, int64_t q_stride,
                                                      const int32_t* kv_ids, int64_t kv_stride, const ScoreBlock& blk,
                                                      int lane) {
  const int32_t* keys = kv_ids + blk.col0 * kv_stride;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
      const bool row_in = r < blk.q_end;
      const int32_t query = row_in ? __ldg(q_ids + (blk.row0 + r) * q_stride) : 0;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = frag_col(nf, c, lane);
          if (!row_in || col >= blk.kv_end || __ldg(keys + col * kv_stride) != query) s[mf][nf][2 * h + c] = -INFINITY;
        }
    }
}

}  // namespace jaxflash::gpu
