// The forward kernel: one CTA per (BLOCK_M query rows, instance), 4 warps each
// owning BLOCK_M / 4 rows outright (no inter-warp reduction anywhere).
#pragma once

#include <cstdint>

#include "fwd_epilogue.h"
#include "fwd_mainloop.h"
#include "fwd_schedule.h"
#include "instance.h"
#include "kernel_traits.h"
#include "primitives/positions.h"
#include "primitives/softmax.h"
#include "../params.h"

namespace jaxflash::gpu {

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads)
    forward_kernel(const __grid_constant__ AttentionParams p, const FwdRuntime launch_rt) {
  extern __shared__ __align__(128) char smem[];
  const typename Cfg::QTile sQ{smem};
  const typename Cfg::KTile sK{smem + Cfg::QTile::kBytes};
  const typename Cfg::VTile sV{smem + Cfg::QTile::kBytes + Cfg::KTile::kBytes};

  const FwdTile tile = forward_tile<Cfg::kBlockM>(p, launch_rt, blockIdx.x);
  const int64_t linear = tile.linear;
  // A scale operand runs the general variant only (fold_scale): the fast one keeps its registers.
  const FwdRuntime rt = Cfg::kGeneral ? with_scale_operand(p, launch_rt, linear) : launch_rt;
  const int m0 = tile.m0;
  const InstanceBounds bounds = instance_bounds(p, linear);
  const KeyRange keys = visible_keys(p, bounds, m0, m0 + Cfg::kBlockM);
  const Positions pos(p, bounds);
  using T = typename Cfg::T;
  FwdOperands<T> ops;
  {
    const InstanceIndex inst(p, linear);
    ops.q = inst.origin<const T>(p, p.q);
    ops.k = inst.origin<const T>(p, p.k);
    ops.v = inst.origin<const T>(p, p.v);
    ops.bias = nullptr, ops.mask = nullptr, ops.seed = nullptr, ops.q_ids = nullptr, ops.kv_ids = nullptr;
    if (Cfg::kGeneral && p.has(kHasBias))
      ops.bias = rt.bias_f32 ? static_cast<const void*>(inst.origin<const float>(p, p.bias))
                             : static_cast<const void*>(inst.origin<const T>(p, p.bias));
    if (Cfg::kGeneral && p.has(kHasMask)) ops.mask = inst.origin<const uint8_t>(p, p.mask);
    if (Cfg::kGeneral && p.has(kDropout)) ops.seed = inst.origin<const uint32_t>(p, p.seed);
    if constexpr (Cfg::kSegmentIds) {
      ops.q_ids = inst.origin<const int32_t>(p, p.q_segment_ids);
      ops.kv_ids = inst.origin<const int32_t>(p, p.kv_segment_ids);
    }
    ops.alibi2 = Cfg::kGeneral ? 1.4426950408889634f * alibi_slope(p, linear) : 0.f;
    ops.o = p.has(kOutputF32) ? static_cast<void*>(inst.origin<float>(p, p.o)) : inst.origin<T>(p, p.o);
    ops.lse = p.lse.data != nullptr ? inst.origin<float>(p, p.lse) : nullptr;
  }

  float o[Cfg::kMF][Cfg::kDF][4];
#pragma unroll
  for (int mf = 0; mf < Cfg::kMF; ++mf)
#pragma unroll
    for (int df = 0; df < Cfg::kDF; ++df)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mf][df][i] = 0.f;
  typename Cfg::State st;
  st.init();

  // No visible key for any row (or all rows padding): the epilogue alone
  // writes O = 0 and lse = -inf.
  if (keys.lo < keys.hi)
    forward_mainloop<Cfg>(p, rt, pos, ops, linear, m0, static_cast<int>(keys.lo),
                          static_cast<int>(keys.hi), sQ, sK, sV, o, st, threadIdx.x);
  forward_epilogue<Cfg>(p, rt, pos, ops.o, ops.lse, m0, sQ, o, st, threadIdx.x);
}

}  // namespace jaxflash::gpu
