// Launcher of one (dtype, padded head dim) instantiation of the forward kernel.
// Included only by the generated instances (cuda/gpu/instance.cu.in), one per pair, so the heavy
// template instantiations build in parallel; forward.cu dispatches to them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "fwd_kernel.h"
#include "fwd_schedule.h"
#include "fwd_sm90_kernel.h"
#include "kernel_traits.h"
#include "../params.h"

namespace jaxflash::gpu {

// Cfg's kernel over every (query tile, instance), in fwd_schedule.h's order: one
// CTA per tile (the mma.sync kernel), or with kPersistent one CTA per SM, at most
// one per tile, that takes tiles in turn from the counter in the workspace
// (rt.tile_counter, which forward.cu zeroed on the stream first).
template <class Cfg, bool kPersistent = false, class Kernel>
cudaError_t launch_query_tiles(Kernel* kernel, const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  constexpr int kSmem = Cfg::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {  // opt in beyond the default 48 KB
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const int64_t num_m = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t blocks = num_m * p.num_instances();
  // (So the kernels decode tile indices in 32 bits: fwd_schedule.h.)
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  FwdRuntime grid_rt = rt;
  grid_rt.tile_group = forward_tile_group(p, rt.sms, num_m);
  grid_rt.tiles = static_cast<int>(blocks);
  grid_rt.instances = static_cast<int>(p.num_instances());
  int64_t grid = blocks;
  if constexpr (kPersistent) grid = std::min<int64_t>(blocks, std::max(rt.sms, 1));
  kernel<<<static_cast<unsigned>(grid), Cfg::kThreads, kSmem, stream>>>(p, grid_rt);
  return cudaGetLastError();
}

// Expects p validated and non-empty (forward.cu). Neither allocates nor
// synchronises, so it can be captured in a CUDA graph. M: the float32 MMA mode
// (forward.cu picks k3xTf32 for kExactF32; the 16-bit types take the default).
template <class T, int D, F32Mma M = F32Mma::kTf32>
cudaError_t launch_forward_instance(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  if constexpr (fwd_sm90_covers(sizeof(T), D)) {
    if (rt.sm90) {  // forward.cu checked the conditions (fwd_sm90_case)
      // The copy for the call's score modifiers (the plain or dropout copy without), with
      // 160-key tiles where forward.cu chose them.
      auto launch = [&](auto mods, auto wide) {
        constexpr FwdMods kMods = decltype(mods)::value;
        constexpr bool kWide = decltype(wide)::value;
        if constexpr (kMods == FwdMods::kNone) {
          using Plain = FwdSm90Config<T, D, false, kMods, kWide>;
          using Dropout = FwdSm90Config<T, D, true, kMods, kWide>;
          return p.has(kDropout) ? launch_query_tiles<Dropout, true>(&forward_sm90_kernel<Dropout>, p, rt, stream)
                                 : launch_query_tiles<Plain, true>(&forward_sm90_kernel<Plain>, p, rt, stream);
        } else {
          using Mods = FwdSm90Config<T, D, false, kMods, kWide>;
          // The scale inside the exp2, as the plain copy takes it: the soft-cap's copy leaves
          // tanh(s scale / cap) as the scores and takes the cap there (FlashAttention-3 does
          // so), ALiBi's and the segment ids' copies leave the raw q.k (ALiBi's term divided by
          // the scale): one multiply per score fewer than folding the scale into the scores.
          FwdRuntime mods_rt = rt;
          if constexpr (kMods == FwdMods::kSoftCap) mods_rt.exp_scale = rt.softcap2;
          if constexpr (kMods == FwdMods::kAlibi) mods_rt.exp_scale = rt.score_mul;
          return launch_query_tiles<Mods, true>(&forward_sm90_kernel<Mods>, p, mods_rt, stream);
        }
      };
      return with_fwd_mods(fwd_sm90_mods(p, rt), [&](auto mods) {
        if constexpr (fwd_sm90_has_wide_keys(D, decltype(mods)::value)) {
          if (rt.sm90_wide_keys) return launch(mods, std::true_type{});
        }
        return launch(mods, std::false_type{});
      });
    }
  }
  using Fast = FwdConfig<T, D, false, M>;
  using General = FwdConfig<T, D, true, M>;
  using WithIds = FwdConfig<T, D, true, M, true>;
  if (p.has(kHasSegmentIds)) return launch_query_tiles<WithIds>(&forward_kernel<WithIds>, p, rt, stream);
  return fwd_fast_case(p, rt) && !p.has(kDropout) && p.head_dim == D
             ? launch_query_tiles<Fast>(&forward_kernel<Fast>, p, rt, stream)
             : launch_query_tiles<General>(&forward_kernel<General>, p, rt, stream);
}

}  // namespace jaxflash::gpu
