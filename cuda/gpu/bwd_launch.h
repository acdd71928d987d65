// Launcher of one (dtype, padded head dim) instantiation of the backward's
// main kernels (mma.sync, and sm_90 where it covers the case) and dbias kernel.
// Included only by the generated instances (cuda/gpu/instance.cu.in, one per
// pair), so the heavy template instantiations build in parallel; backward.cu
// validates, runs the pre / post passes and dispatches here.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "bwd_dbias.h"
#include "bwd_kernel.h"
#include "bwd_kernel_traits.h"
#include "bwd_sm90_kernel.h"
#include "../params.h"

namespace jaxflash::gpu {

// Always set: the kernels also hold a little static shared memory, so even
// 48 KB of dynamic memory needs the opt-in.
template <class Kernel>
cudaError_t raise_smem_limit(Kernel* kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <class T, int D, bool kGeneral, F32Mma M, bool kSoftcap = false, bool kSegmentIds = false>
cudaError_t launch_backward_main(const AttentionParams& p, const BwdRuntime& rt, cudaStream_t stream) {
  using Cfg = BwdConfig<T, D, kGeneral, M, kSoftcap, kSegmentIds>;
  auto* kernel = &backward_kernel<Cfg>;
  const int smem = bwd_smem_bytes(Cfg::kTiles, sizeof(T), D, rt.dq_bulk);  // as backward.cu checks it
  if (const cudaError_t err = raise_smem_limit(kernel, smem); err != cudaSuccess) return err;
  const int64_t blocks = rt.kv_kept * rt.k_tiles;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, smem, stream>>>(p, rt);
  return cudaGetLastError();
}

template <class T, int D, bool kDropout, bool kScoreMods = false, bool kSegmentIds = false>
cudaError_t launch_backward_sm90(const AttentionParams& p, const BwdRuntime& rt, cudaStream_t stream) {
  using Cfg = BwdSm90Config<T, D, kDropout, kScoreMods, kSegmentIds>;
  auto* kernel = &backward_sm90_kernel<Cfg>;
  if (const cudaError_t err = raise_smem_limit(kernel, Cfg::kSmemBytes); err != cudaSuccess) return err;
  // Persistent: a CTA per SM (one fits), each taking tickets until they run out.
  if (rt.tickets == 0) return cudaSuccess;
  if (rt.tickets > INT_MAX - rt.sms) return cudaErrorInvalidConfiguration;  // the counter is an int
  const int64_t blocks = std::min<int64_t>(rt.tickets, rt.sms);
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, rt);
  return cudaGetLastError();
}

template <class T, int D, F32Mma M, class BiasT, bool kSegmentIds = false>
cudaError_t launch_backward_dbias(const AttentionParams& p, const BwdRuntime& rt, cudaStream_t stream) {
  if constexpr (!kSegmentIds)
    if (p.has(kHasSegmentIds)) return launch_backward_dbias<T, D, M, BiasT, true>(p, rt, stream);
  using Cfg = BwdConfig<T, D, true, M, false, kSegmentIds>;
  auto* kernel = &dbias_kernel<Cfg, BiasT>;
  if (const cudaError_t err = raise_smem_limit(kernel, Cfg::kDbiasSmemBytes); err != cudaSuccess) return err;
  int64_t blocks = rt.dbias_kept;
  if (!rt.dbias_one_col || !rt.dbias_one_row) blocks *= rt.dbias_one_row ? rt.k_tiles : rt.q_tiles;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kDbiasSmemBytes, stream>>>(p, rt);
  return cudaGetLastError();
}

// Expects p validated, rt filled and the workspace prepared (backward.cu). M:
// the float32 MMA mode (backward.cu picks k3xTf32 for kExactF32; the 16-bit
// types take the default).
template <class T, int D, F32Mma M = F32Mma::kTf32>
cudaError_t launch_backward_instance(const AttentionParams& p, const BwdRuntime& rt, cudaStream_t stream) {
  if constexpr (bwd_sm90_covers(sizeof(T), D)) {
    if (rt.sm90) {  // no bias, so no dbias; dropout and score modifiers not together (backward.cu)
      // Segment ids without a soft-cap or ALiBi run a copy without those (the copy with them
      // measured 1-4% slower on packed documents: H200, 2026-11-29).
      const bool ids = p.has(kHasSegmentIds), mods = p.softcap > 0.f || p.has(kHasAlibi);
      return p.has(kDropout) ? launch_backward_sm90<T, D, true>(p, rt, stream)
             : ids && mods   ? launch_backward_sm90<T, D, false, true, true>(p, rt, stream)
             : ids           ? launch_backward_sm90<T, D, false, false, true>(p, rt, stream)
             : mods          ? launch_backward_sm90<T, D, false, true>(p, rt, stream)
                             : launch_backward_sm90<T, D, false>(p, rt, stream);
    }
  }
  // Segment ids with ALiBi run the copy for ids and a soft-cap (bwd_scores.h: the copy for
  // ids alone has no ALiBi code).
  const bool ids = p.has(kHasSegmentIds), cap = p.softcap > 0.f, alibi = p.has(kHasAlibi);
  cudaError_t err = !rt.general   ? launch_backward_main<T, D, false, M>(p, rt, stream)
                    : ids && (cap || alibi) ? launch_backward_main<T, D, true, M, true, true>(p, rt, stream)
                    : ids         ? launch_backward_main<T, D, true, M, false, true>(p, rt, stream)
                    : cap         ? launch_backward_main<T, D, true, M, true>(p, rt, stream)
                                  : launch_backward_main<T, D, true, M>(p, rt, stream);
  if (err != cudaSuccess || !p.has(kHasDbias) || p.seqlen_q == 0 || p.seqlen_k == 0) return err;
  if constexpr (sizeof(T) == 4) {
    return launch_backward_dbias<T, D, M, float>(p, rt, stream);
  } else {
    return rt.bias_f32 ? launch_backward_dbias<T, D, M, float>(p, rt, stream)
                       : launch_backward_dbias<T, D, M, T>(p, rt, stream);
  }
}

}  // namespace jaxflash::gpu
