// Inter-CTA ordering primitives of the backward's deterministic dQ
// accumulation (bwd_kernel.h): acquire loads and release increments of the
// per-warp semaphores, and on sm_90 the bulk (TMA) reduction of a dQ partial
// from shared memory.
#pragma once

#include <cstdint>

#include "ptx.h"
#include "tma.h"

namespace jaxflash::gpu {

// sm_90+: dQ partials go through shared memory and a bulk (TMA) reduction;
// otherwise through fp32 atomics. JAXFLASH_BWD_NO_BULK (defined for every
// translation unit, backward.cu included) forces the atomic path everywhere,
// so the sm_80 code path can be tested on a Hopper GPU.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(JAXFLASH_BWD_NO_BULK)
#define JF_BWD_DQ_BULK 1
#else
#define JF_BWD_DQ_BULK 0
#endif

__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// *ptr += v with release semantics at GPU scope: this thread's earlier writes
// (and, through a preceding barrier, its CTA's) are visible to whoever
// acquires the new value. Cheaper than a full fence (__threadfence) + atomic.
__device__ __forceinline__ void red_release_gpu(int* ptr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}

// sm_90 bulk (TMA) reduction of a contiguous shared-memory block into global
// memory: dst[i] += src[i] (fp32, at L2), `bytes` a multiple of 16, both ends
// 16-byte aligned. Issued by one thread; completion is tracked per thread
// through bulk async-groups.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, int bytes) {
#if JF_BWD_DQ_BULK
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
#endif
}
// The same copy without the add: dst[i] = src[i] (a dQ tile's first turn, bwd_dq.h).
__device__ __forceinline__ void bulk_store_f32(float* dst, const float* src, int bytes) {
#if JF_BWD_DQ_BULK
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
#endif
}

}  // namespace jaxflash::gpu
