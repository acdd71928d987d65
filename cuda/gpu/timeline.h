// Per-CTA event times of the sm_90 kernels, for profiling only.
//
// The backward: compiled in
// with -DJAXFLASH_BWD_TIMELINE (scripts/profile_kernel.sh bwd D N causal|full
// timeline), absent otherwise. Each (persistent) CTA stamps the GPU's global
// timer (ns) at the events below of its item kTlItem, the second, whose K / V
// and first Q tile were loaded while the first item ran, into its row of a
// device buffer that backward.cu allocates (bwd_timeline_buffer);
// bwd_selftest's bench prints where that item's time goes (setup, the wait for
// K / V, for the first Q tile, the Q-tile loop, the dK / dV stores, the dQ
// writer's drain, and per dQ tile the writer's wait for its turn and its
// reduction's time to the turn's release): what the persistent grid leaves exposed. Nsight Compute
// samples stalls by source line, but cannot say how long an item waits before
// its first product or after its last.
//
// The forward: compiled in with -DJAXFLASH_FWD_TIMELINE (scripts/profile_kernel.sh fwd D N
// causal|full timeline). Each consumer warpgroup's first thread sums, over every query tile it
// computes, the time from one event to the next (FwdTimelinePhase) into its CTA's row of a
// device buffer that forward.cu allocates (fwd_timeline_buffer); fwd_selftest's bench prints
// the means per tile: what a tile spends besides its rounds of products, which at N = 1k is
// ~5 us of ~18 (docs/DESIGN.md).
#pragma once

#include <cuda_runtime.h>

namespace jaxflash::gpu {

enum FwdTimelinePhase : int {
  kFtQWait = 0,      // the tile received -> its Q in shared memory
  kFtFirstS = 1,     // -> its first S product issued (the first K tile, the turn)
  kFtRounds = 2,     // -> the rounds' loop done (every S product and softmax)
  kFtLastPv = 3,     // -> the last P V product done
  kFtEpilogue = 4,   // -> O and lse stored
  kFtNext = 5,       // -> the next tile received
  kFtTiles = 6,      // tiles computed
  kFtRoundCount = 7,  // key tiles computed
  kFtPhases = 8,
  kFtRowWords = 4 * kFtPhases,  // a CTA's row: up to three consumer warpgroups (and a spare)
};

enum BwdTimelineEvent : int {
  kTlStart = 0,       // consumer 0: the item received
  kTlKvIssue = 1,     // consumer 0: about to wait for the item's K / V
  kTlKvLoaded = 2,    // consumer 0: the item's K / V in shared memory
  kTlFirstQ = 3,      // consumer 0: the item's first Q tile has landed
  kTlLoopDone = 4,    // consumer 0: its last Q tile handed to the writer, K / V released
  kTlEpiStored = 5,   // consumer 0: its dK / dV stores issued
  kTlWriterDone = 6,  // the dQ writers: the item's last turn signalled
  kTlWriterSpin = 7,  // the dQ writers: ns spent waiting for the item's turns, summed
  kTlWriterAdd = 8,   // the dQ writers: ns from issuing a tile's reduction to its turn's release, summed
  kTlWriterTiles = 9,  // the dQ writers: the item's tiles
  kTlEvents = 10,     // a CTA's row
  kTlCtas = 8192,     // rows: CTAs past these wrap
  kTlItem = 1,        // the item stamped
};

#if defined(JAXFLASH_BWD_TIMELINE) || defined(JAXFLASH_FWD_TIMELINE)
__device__ __forceinline__ unsigned long long timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

#if defined(JAXFLASH_BWD_TIMELINE) || defined(JAXFLASH_FWD_TIMELINE)
// A launch's timeline: `buffer` (one per direction, kept across launches) allocated at the
// first launch and zeroed on the stream before each, `words` per CTA row.
inline cudaError_t zeroed_timeline(unsigned long long*& buffer, int words, cudaStream_t stream) {
  const size_t bytes = sizeof(unsigned long long) * kTlCtas * words;
  if (buffer == nullptr)
    if (const cudaError_t e = cudaMalloc(&buffer, bytes); e != cudaSuccess) return e;
  return cudaMemsetAsync(buffer, 0, bytes, stream);
}
#endif

// A consumer warpgroup's stamps over one query tile (the forward's phases above), summed into
// its CTA's row by `add`; nothing without -DJAXFLASH_FWD_TIMELINE.
struct FwdStamps {
#ifdef JAXFLASH_FWD_TIMELINE
  unsigned long long t[kFtTiles + 1];  // event e ends phase e - 1; t[0]: the tile received
  __device__ __forceinline__ void now(int event) { t[event] = timeline_now(); }
  // Phases 0 .. kFtEpilogue of this tile, and the gap from the previous tile's end.
  __device__ __forceinline__ void add(unsigned long long* row, int wg, unsigned long long prev_end, int rounds) const {
    unsigned long long* w = row + wg * kFtPhases;
    for (int e = kFtQWait; e <= kFtEpilogue; ++e) atomicAdd(w + e, t[e + 1] - t[e]);
    if (prev_end != 0) atomicAdd(w + kFtNext, t[0] - prev_end);
    atomicAdd(w + kFtTiles, 1ull);
    atomicAdd(w + kFtRoundCount, static_cast<unsigned long long>(rounds));
  }
#else
  __device__ __forceinline__ void now(int) {}
#endif
};

#ifdef JAXFLASH_BWD_TIMELINE
constexpr bool kTlEnabled = true;
// The event's word in this CTA's row.
#define JF_TIMELINE_SLOT(rt, event) \
  ((rt).timeline[(blockIdx.x % ::jaxflash::gpu::kTlCtas) * ::jaxflash::gpu::kTlEvents + (event)])
#define JF_TIMELINE(rt, event, value) (JF_TIMELINE_SLOT(rt, event) = (value))
#define JF_TIMELINE_NOW(rt, event) JF_TIMELINE(rt, event, ::jaxflash::gpu::timeline_now())
// For events that several warps stamp (the dQ writers): sums add, ends keep the latest.
#define JF_TIMELINE_ADD(rt, event, value) atomicAdd(&JF_TIMELINE_SLOT(rt, event), (value))
#define JF_TIMELINE_MAX_NOW(rt, event) atomicMax(&JF_TIMELINE_SLOT(rt, event), ::jaxflash::gpu::timeline_now())
#else
constexpr bool kTlEnabled = false;
#define JF_TIMELINE(rt, event, value) ((void)0)
#define JF_TIMELINE_NOW(rt, event) ((void)0)
#define JF_TIMELINE_ADD(rt, event, value) ((void)0)
#define JF_TIMELINE_MAX_NOW(rt, event) ((void)0)
#endif

}  // namespace jaxflash::gpu
