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

template <class T, int D, bool kGeneral, F32Mma M>
cudaError_t launch_forward_config(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  using Cfg = FwdConfig<T, D, kGeneral, M>;
  auto* kernel = &forward_kernel<Cfg>;
  constexpr int kSmem = Cfg::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {  // opt in beyond the default 48 KB
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const int64_t num_m = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM, instances = p.num_instances();
  const int64_t blocks = num_m * instances;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  FwdRuntime grid_rt = rt;
  grid_rt.tile_group = forward_tile_group(p, rt.sms, num_m);
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, kSmem, stream>>>(p, grid_rt);
  return cudaGetLastError();
}

// The sm_90 kernel: one CTA per query tile as above, 384 threads, one CTA per SM.
template <class T, int D, bool kDropout>
cudaError_t launch_forward_sm90(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  using Cfg = FwdSm90Config<T, D, kDropout>;
  auto* kernel = &forward_sm90_kernel<Cfg>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t num_m = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int64_t blocks = num_m * p.num_instances();
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  FwdRuntime grid_rt = rt;
  grid_rt.tile_group = forward_tile_group(p, rt.sms, num_m);
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, grid_rt);
  return cudaGetLastError();
}

// Expects p validated and non-empty (forward.cu). Neither allocates nor
// synchronises, so it can be captured in a CUDA graph. M: the float32 MMA mode
// (forward.cu picks k3xTf32 for kExactF32; the 16-bit types take the default).
template <class T, int D, F32Mma M = F32Mma::kTf32>
cudaError_t launch_forward_instance(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  if constexpr (fwd_sm90_covers(sizeof(T), D))
    if (rt.sm90)  // forward.cu checked the conditions
      return p.has(kDropout) ? launch_forward_sm90<T, D, true>(p, rt, stream)
                             : launch_forward_sm90<T, D, false>(p, rt, stream);
  const bool fast = !p.has(kHasBias) && !p.has(kHasMask) && !p.has(kDropout) && !rt.fold_scale &&
                    p.head_dim == D && rt.q_vec && rt.k_vec && rt.v_vec;
  return fast ? launch_forward_config<T, D, false, M>(p, rt, stream)
              : launch_forward_config<T, D, true, M>(p, rt, stream);
}

}  // namespace jaxflash::gpu
