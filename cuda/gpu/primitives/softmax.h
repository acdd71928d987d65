// Online softmax over the score fragments (FlashAttention-2 style): running
// row max and row sum in fp32, exp2 with log2(e) already folded into the scale,
// and a single normalisation of O after the last key tile.
#pragma once

#include <cmath>

#include "ptx.h"
#include "../../params.h"

namespace jaxflash::gpu {

// Per-lane state of the 2 MF rows it holds (rows g and g + 8 of each m16
// fragment; see mma.h). kTrackMax: keep each row's largest score, for
// softmax_finalize's correction of the normaliser (two registers per m16 row).
template <int MF, bool kTrackMax_ = true>
struct SoftmaxState {
  static constexpr bool kTrackMax = kTrackMax_;
  // The row's exp2 offset: fmaf(running max of the scores, exp_scale, p_shift), in base-2
  // units; -inf until a visible key. Kept as the offset itself, not the max, so that the
  // rescaling between tiles and the lse refer to exactly the floats the P were taken at (at
  // scores of 1e4 one rounding there is ~1e-3). fmaf rounds monotonically and exp_scale > 0,
  // so the offset of the max is the max of the offsets.
  float offset[MF][2];
  float sum[MF][2];  // this lane's columns only: the quad is summed once, at the end
  // The row's largest score so far (as s reaches the softmax; -inf until a visible key): the
  // key of the largest P, whose rounding for the P·V product softmax_finalize takes into the
  // normaliser.
  float max[MF][2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) offset[mf][h] = -INFINITY, sum[mf][h] = 0.f, max[mf][h] = -INFINITY;
  }
};

// A row of a C fragment is spread over the 4 lanes of a quad.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x on the FMA pipe, for a share of the softmax's scores where the SFU is the busier pipe
// (the sm_90 forward's soft-cap copy: each score's exp2 and tanh, tile_size.h's
// kExp2PolyEvery). x = j + f with j = round(x) and f in [-0.5, 0.5]: 2^f by a cubic (fitted for the least maximal relative error
// on [-0.5, 0.5], 7.5e-5 in float32, below the half ulp of the 16-bit P it feeds: 2.4e-4 for
// fp16, 2e-3 for bf16), 2^j from its exponent bits. Adding 1.5 * 2^23 + 127 puts j + 127 in the
// sum's low mantissa bits (round to nearest; __fadd_rn, so that the compiler cannot fold the add
// and its subtraction away), and shifting them by 23 makes 2^j's float. Scores below -126
// (masked ones: -inf) give +0, as ex2 does; NaN gives NaN (through f). x <= 127 (the softmax's
// offsets keep it <= its p_shift).
__device__ __forceinline__ float poly_exp2(float x) {
  constexpr float kShifter = 12582912.f + 127.f;  // 1.5 * 2^23 + the exponent bias
  const float t = __fadd_rn(x, kShifter);
  const float f = __fsub_rn(x, __fsub_rn(t, kShifter));
  float p = fmaf(0.0551716648f, f, 0.242611125f);
  p = fmaf(p, f, 0.693260968f);
  p = fmaf(p, f, 0.999928057f);
  const float two_j = __int_as_float(__float_as_int(t) << 23);
  return x < -126.f ? 0.f : p * two_j;
}

// Folds one tile of scores into the state: s becomes P = exp2(s * exp_scale -
// offset), the sums move to the new offset, and rescale(mf, h, alpha) gets
// each row's factor from the old offset to the new one, which O has to take:
// at once (online_softmax), or, in the sm_90 forward, once its in-flight
// product with the previous P is done. exp_scale > 0 (the launcher guarantees
// it), so the max of s is the max of the scaled scores. P carries the factor
// 2^-p_shift (FwdRuntime: it keeps the sum of P.V finite); the sums carry it
// too, and softmax_finalize takes it out of lse. kPolyEvery > 0: every
// kPolyEvery-th n-fragment's scores take poly_exp2 (the FMA pipe) instead of the SFU.
template <int kPolyEvery = 0, int MF, int NF, class State, class Rescale>
__device__ __forceinline__ void softmax_update(float (&s)[MF][NF][4], State& st, float exp_scale,
                                               float p_shift, Rescale&& rescale) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = -INFINITY;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) m = fmaxf(m, fmaxf(s[mf][nf][2 * h], s[mf][nf][2 * h + 1]));
      m = quad_max(m);
      if constexpr (State::kTrackMax) st.max[mf][h] = fmaxf(st.max[mf][h], m);
      const float offset = fmaxf(st.offset[mf][h], fmaf(m, exp_scale, p_shift));
      // Still no visible key: subtract 0 (exp2(-inf - 0) = 0, not exp2(-inf + inf) = NaN).
      const float p_offset = offset == -INFINITY ? 0.f : offset;
      // Old offset -inf (nothing seen yet): exp2(-inf) = 0, and O and sum are 0 anyway.
      const float alpha = fast_exp2(st.offset[mf][h] - p_offset);
      st.offset[mf][h] = offset;
      float sum = 0.f;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[mf][nf][2 * h + c];
          const float e = fmaf(x, exp_scale, -p_offset);  // one FFMA + one MUFU per score
          if constexpr (kPolyEvery > 0) x = nf % kPolyEvery == kPolyEvery - 1 ? poly_exp2(e) : fast_exp2(e);
          else x = fast_exp2(e);
          sum += x;
        }
      }
      st.sum[mf][h] = st.sum[mf][h] * alpha + sum;
      rescale(mf, h, alpha);
    }
  }
}

// Row h of fragment row mf of O times alpha.
template <int MF, int DF>
__device__ __forceinline__ void rescale_row(float (&o)[MF][DF][4], int mf, int h, float alpha) {
#pragma unroll
  for (int df = 0; df < DF; ++df) o[mf][df][2 * h] *= alpha, o[mf][df][2 * h + 1] *= alpha;
}

// The mma.sync forward's step: O rescaled row by row as the factors come.
template <int MF, int NF, int DF, bool kTrackMax>
__device__ __forceinline__ void online_softmax(float (&s)[MF][NF][4], float (&o)[MF][DF][4],
                                               SoftmaxState<MF, kTrackMax>& st,
                                               float exp_scale, float p_shift) {
  softmax_update(s, st, exp_scale, p_shift, [&](int mf, int h, float alpha) { rescale_row(o, mf, h, alpha); });
}

// After the last tile: O *= out_scale / sum, and per row the lse in base 2 as
// params.h's two floats: the row's offset plus log2(sum), split without rounding.
// The sum is of the float32 P, but O's is of P as the P·V product took it
// (as_operand: rounded to the input's 16 bits, or to tf32): for every key but one
// the difference is rounding noise, as in jax.nn's own P·V, but the largest P is
// 2^r with r = fmaf(max, exp_scale, -offset), the offset's own rounding, not 1,
// and where a row's attention is on one key its rounding is the row's whole error,
// the same sign in every output and gradient: at logits of 1e4 (offset ulp 2^-9) up
// to 2^-11 relative in fp16, several times jax.nn's (test_numerics' large logits).
// With `correct_max` that P's rounding goes into O's normaliser: O is then exact for
// a one-hot row. (Not under dropout, which may have dropped that key from O.)
// Rows that saw no visible key (sum == 0) or are not `live` (query padding)
// get O = 0 and lse = (-inf, 0). A NaN score (NaN in q, k or bias) makes the sum NaN
// and so O and lse NaN, as in jax.nn: fmaxf drops NaN from the max, so the sum
// is the only place it surfaces, and "sum > 0" would take it for an empty row.
// out_scale is 1, or dropout's 1 / (1 - rate). store_lse(mf, h, lse) takes each row's
// lse as it is formed.
template <int MF, int DF, bool kTrackMax, class AsOperand, class StoreLse>
__device__ __forceinline__ void softmax_finalize(float (&o)[MF][DF][4], const SoftmaxState<MF, kTrackMax>& st,
                                                 float out_scale, const bool (&live)[MF][2], float exp_scale,
                                                 bool correct_max, AsOperand&& as_operand, StoreLse&& store_lse) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(st.sum[mf][h]);
      const bool any = live[mf][h] && !(sum == 0.f);
      float norm = sum;
      if (kTrackMax && correct_max && any) {
        const float top = fast_exp2(fmaf(st.max[mf][h], exp_scale, -st.offset[mf][h]));  // as softmax_update
        norm += as_operand(top) - top;
      }
      const float inv = any ? out_scale / norm : 0.f;
      store_lse(mf, h, any ? split_lse(st.offset[mf][h], log2f(sum))
                           : LseSplit{-INFINITY, 0.f});
#pragma unroll
      for (int df = 0; df < DF; ++df) o[mf][df][2 * h] *= inv, o[mf][df][2 * h + 1] *= inv;
    }
  }
}

}  // namespace jaxflash::gpu
