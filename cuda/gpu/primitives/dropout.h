// Attention dropout on C fragments (warp_gemm.h's layout): the keep decisions
// of cuda/dropout.h for the scores a lane holds. A lane's rows are few (2 per
// m16 fragment), so their keys are hashed once per block of rows; a lane holds
// keys s and s + 8 of each row in fragments 2j and 2j + 1, the pair one hash
// decides.
#pragma once

#include <cstdint>

#include "warp_gemm.h"
#include "../../dropout.h"

namespace jaxflash::gpu {

// The row keys of the lane's rows of a warp block whose first query is row0.
template <int MF>
struct FragRowKeys {
  uint32_t key[MF][2];

  __device__ __forceinline__ FragRowKeys(const DropoutKey& dropout, int64_t row0, int lane) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) key[mf][h] = dropout.row_key(row0 + frag_row(mf, 2 * h, lane));
  }
};

// f(mf, nf, i, keep) for every score of the lane's block (NF n8 fragments wide)
// whose first key is col0, a multiple of 16 when NF is even (the callers' tile
// and warp origins, as is the block's column offset: cuda/dropout.h), so that
// fragments 2j and 2j + 1 hold each pair's lower and upper keys. (An odd NF, the float32 D = 192 / 256 backward's 8-column warps,
// decides each score alone.)
template <int NF, int MF, class F>
__device__ __forceinline__ void for_each_dropout_decision(const DropoutKey& dropout, const FragRowKeys<MF>& rows,
                                                          int64_t col0, int lane, F&& f) {
  if constexpr (NF % 2 == 0) {
    // Fragment 2j's key is 16 j + frag_col(0, c, lane) past col0, so with col0 (and the
    // block's column offset) a multiple of 16 its pair is dropout.pair(col0) + 8 j + that of
    // frag_col(0, c, lane) < 8: the terms are the block's plus constants, one product a
    // block instead of one a pair (the pair's shifts and product were ~8% of the dropout
    // copy's instructions between the sm_90 forward's waits).
    // The hash's first step taken apart (cuda/dropout.h's dropout_mix_first): once a row and
    // once a pair instead of once a hash.
    const uint32_t block_term = dropout_pair_term(dropout.pair(col0));
    uint32_t row_first[MF][2];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_first[mf][h] = dropout_mix_first(rows.key[mf][h]);
#pragma unroll
    for (int j = 0; j < NF / 2; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const uint32_t term_first = dropout_mix_first(
            block_term + dropout_pair_term(8u * j) + dropout_pair_term(dropout_pair(frag_col(0, c, lane))));
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t bits = dropout_mix_rest(row_first[mf][h] ^ term_first);
            f(mf, 2 * j, 2 * h + c, dropout_keep_lower(bits, dropout.threshold));
            f(mf, 2 * j + 1, 2 * h + c, dropout_keep_upper(bits, dropout.threshold));
          }
      }
  } else {
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int64_t col = col0 + frag_col(nf, c, lane);
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int h = 0; h < 2; ++h) f(mf, nf, 2 * h + c, dropout.keep(rows.key[mf][h], col));
      }
  }
}

// P of the forward: the dropped entries become P * 0 (kept ones are scaled once,
// at the end). Here and in the backwards a dropped entry is a product with 0,
// never a 0 put in its place: a NaN stays NaN, as in jax.nn's math with dropout.
template <int MF, int NF>
__device__ __forceinline__ void drop_probabilities(float (&p)[MF][NF][4], const DropoutKey& dropout,
                                                   const FragRowKeys<MF>& rows, int64_t col0, int lane) {
  for_each_dropout_decision<NF>(dropout, rows, col0, lane, [&](int mf, int nf, int i, bool keep) {
    if (!keep) p[mf][nf][i] *= 0.f;  // (a predicated product: one instruction where keep ? 1 : 0 took two)
  });
}

}  // namespace jaxflash::gpu
