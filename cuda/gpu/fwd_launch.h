// Launcher of one (dtype, padded head dim) instantiation of the forward kernel.
// Included only by the instantiations/*.cu files, one per pair, so the heavy
// template instantiations build in parallel; forward.cu dispatches to them.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "fwd_kernel.h"
#include "kernel_traits.h"
#include "../params.h"

namespace jaxflash::gpu {

template <class T, int D, bool kGeneral>
cudaError_t launch_forward_config(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  using Cfg = FwdConfig<T, D, kGeneral>;
  auto* kernel = &forward_kernel<Cfg>;
  constexpr int kSmem = Cfg::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {  // opt in beyond the default 48 KB
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  const int64_t blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM * p.num_instances();
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, kSmem, stream>>>(p, rt);
  return cudaGetLastError();
}

// Expects p validated and non-empty (forward.cu). Neither allocates nor
// synchronises, so it can be captured in a CUDA graph.
template <class T, int D>
cudaError_t launch_forward_instance(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  const bool fast = !p.has(kHasBias) && !p.has(kHasMask) && !rt.fold_scale && p.head_dim == D && rt.q_vec &&
                    rt.k_vec && rt.v_vec;
  return fast ? launch_forward_config<T, D, false>(p, rt, stream) : launch_forward_config<T, D, true>(p, rt, stream);
}

}  // namespace jaxflash::gpu
