// The forward's score step, shared by the mma.sync kernel (fwd_mainloop.h) and
// the sm_90 one's general copy (fwd_sm90_mainloop.h): from a warp's block of
// raw Q.K^T, the scores its softmax takes (primitives/score.h's steps in
// params.h's order). Both kernels' accumulators hold a warp's rows in mma.sync's
// m16 fragment layout, so one step serves both.
#pragma once

#include <type_traits>

#include "kernel_traits.h"
#include "primitives/alibi.h"
#include "primitives/positions.h"
#include "primitives/score.h"
#include "../params.h"

namespace jaxflash::gpu {

// The segment ids' per-element test over the warp's block of the score tile at (row0, n0):
// a query sees a key only where their ids are equal.
template <class T, int MF, int NF>
__device__ __forceinline__ void segment_id_scores(float (&s)[MF][NF][4], const AttentionParams& p,
                                                  const Positions& pos, const FwdOperands<T>& ops, int row0, int n0,
                                                  int lane) {
  const int64_t qs = p.q_segment_ids.row_stride, ks = p.kv_segment_ids.row_stride;
  apply_segment_ids(s, ops.q_ids + row0 * qs, qs, ops.kv_ids + n0 * ks, ks, pos.q_len - row0, pos.kv_len - n0, lane);
}

// Scale, bias and masks of the warp's block of one score tile (see score.h).
// The fast variant sees neither bias nor mask nor segment ids nor a folded
// scale; tiles every row sees whole (`full`) skip the position mask, and tiles
// whose rows and keys all hold one id (`!segment_test`) the id test.
template <class Cfg>
__device__ __forceinline__ void score_tile(float (&s)[Cfg::kMF][Cfg::kNF][4], const AttentionParams& p,
                                           const FwdRuntime& rt, const Positions& pos,
                                           const FwdOperands<typename Cfg::T>& ops,
                                           int row0, int n0, bool full, bool segment_test, int lane) {
  using T = typename Cfg::T;
  if constexpr (Cfg::kGeneral) {
    // The soft-cap acts on the scaled logits, before the bias (params.h).
    const bool capped = rt.softcap2 > 0.f;
    if (capped) soft_cap_scores<T>(s, rt.score_mul, rt.softcap2);
    if (Cfg::kBiasMask && ops.bias != nullptr) {
      const ArrayView& v = p.bias;
      const float mul = capped ? 1.f : rt.score_mul;
      auto add = [&](auto unit_col, auto* ptr) {
        using BiasT = std::remove_const_t<std::remove_pointer_t<decltype(ptr)>>;
        add_bias<decltype(unit_col)::value>(s, QueryKeyView<BiasT>{ptr, v.row_stride, v.col_stride}, row0, n0,
                                            pos, mul, lane);
      };
      // A unit column stride (the usual layout) gets immediate-offset loads.
      if (rt.bias_f32) {
        if (v.col_stride == 1) add(std::true_type{}, static_cast<const float*>(ops.bias));
        else add(std::false_type{}, static_cast<const float*>(ops.bias));
      } else {
        if (v.col_stride == 1) add(std::true_type{}, static_cast<const T*>(ops.bias));
        else add(std::false_type{}, static_cast<const T*>(ops.bias));
      }
    } else if (rt.fold_scale && !capped) {
      scale_scores(s, rt.score_mul);
    }
    // After the soft-cap, with the bias (params.h); ALiBi sets fold_scale (forward.cu), so
    // the scores are in base-2 units here.
    if (ops.alibi2 != 0.f) alibi_scores(s, row0 + pos.offset - n0, 1.f, ops.alibi2, lane);
  }
  if (!full) mask_positions(s, BlockWindow(pos, row0, n0), lane);
  if constexpr (Cfg::kGeneral) {
    if (Cfg::kBiasMask && ops.mask != nullptr) {
      const QueryKeyView<uint8_t> view{ops.mask, p.mask.row_stride, p.mask.col_stride};
      if (view.col_stride == 1) apply_mask<true>(s, view, row0, n0, pos, lane);
      else apply_mask<false>(s, view, row0, n0, pos, lane);
    }
    if (Cfg::kSegmentIds && segment_test) segment_id_scores(s, p, pos, ops, row0, n0, lane);
  }
}

}  // namespace jaxflash::gpu
