// ALiBi on a warp's block of score fragments (params.h): the forward's and the backward's
// logits epilogues (score.h, bwd_score.h) share it.
#pragma once

#include <cstdlib>

#include "warp_gemm.h"

namespace jaxflash::gpu {

// s = s * mul - slope2 * |key - query - offset| on the block whose row 0's diagonal is at
// block column `diag` (row0 + offset - col0), so an element's distance is |col - row - diag|;
// slope2 = log2 e * slope and mul = 1 on base-2 scores (else scale * log2 e, which makes them
// so). The distance is an exact int (CUDA positions stay below 2^28), rounded to float once,
// as the CPU kernels round it.
template <int MF, int NF>
__device__ __forceinline__ void alibi_scores(float (&s)[MF][NF][4], int diag, float mul, float slope2, int lane) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[mf][nf][2 * h + c];
          x = fmaf(-slope2, static_cast<float>(abs(frag_col(nf, c, lane) - r - diag)), x * mul);
        }
    }
}

}  // namespace jaxflash::gpu
