// ALiBi on a warp's block of score fragments (params.h): the forward's and the backward's
// logits epilogues (score.h, bwd_score.h) share it.
#pragma once

#include "warp_gemm.h"

namespace jaxflash::gpu {

// s = s * mul - slope2 * |key - query - offset| on the block whose row 0's diagonal is at
// block column `diag` (row0 + offset - col0), so an element's distance is |col - row - diag|;
// slope2 = log2 e * slope and mul = 1 on base-2 scores (else scale * log2 e, which makes them
// so). The distance is formed in float arithmetic on integers: the lane's first column's
// distance converted once per row, each element's a float add of its column offset (an
// immediate), and |.| an operand modifier of the FMA, instead of an integer add, |.| and a
// conversion (I2FP) per element (SASS of the sm_90 score-modifier copy, bf16 D = 128: 64
// conversions fewer per key tile, 144 instructions fewer in all). Exact, as the CPU kernels'
// one rounding of the int, while distances stay below 2^24 (16M positions); CUDA positions
// stay below 2^28, where it is within an ulp of the distance.
template <int MF, int NF>
__device__ __forceinline__ void alibi_scores(float (&s)[MF][NF][4], int diag, float mul, float slope2, int lane) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float first = static_cast<float>(frag_col(0, 0, lane) - frag_row(mf, 2 * h, lane) - diag);
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[mf][nf][2 * h + c];
          // frag_col(nf, c, lane) - frag_col(0, 0, lane) = 8 nf + c
          x = fmaf(-slope2, fabsf(first + static_cast<float>(8 * nf + c)), x * mul);
        }
    }
}

}  // namespace jaxflash::gpu
