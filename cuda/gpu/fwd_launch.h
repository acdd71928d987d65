// Launcher of one (dtype, padded head dim) instantiation of the forward kernel.
// Included only by the generated instances (cuda/gpu/instance.cu.in), one per pair, so the heavy
// template instantiations build in parallel; forward.cu dispatches to them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "fwd_kernel.h"
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
  grid_rt.tile_group = std::min(std::max<int64_t>((4 * int64_t{rt.sms} + num_m - 1) / num_m, 1), instances);
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, kSmem, stream>>>(p, grid_rt);
  return cudaGetLastError();
}

// Expects p validated and non-empty (forward.cu). Neither allocates nor
// synchronises, so it can be captured in a CUDA graph. M: the float32 MMA mode
// (forward.cu picks k3xTf32 for kExactF32; the 16-bit types take the default).
template <class T, int D, F32Mma M = F32Mma::kTf32>
cudaError_t launch_forward_instance(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  const bool fast = !p.has(kHasBias) && !p.has(kHasMask) && !p.has(kDropout) && !rt.fold_scale &&
                    p.head_dim == D && rt.q_vec && rt.k_vec && rt.v_vec;
  return fast ? launch_forward_config<T, D, false, M>(p, rt, stream)
              : launch_forward_config<T, D, true, M>(p, rt, stream);
}

}  // namespace jaxflash::gpu
