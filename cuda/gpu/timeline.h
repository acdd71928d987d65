// Per-CTA event times of the sm_90 backward, for profiling only: compiled in
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
#pragma once

namespace jaxflash::gpu {

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

#ifdef JAXFLASH_BWD_TIMELINE
constexpr bool kTlEnabled = true;
__device__ __forceinline__ unsigned long long timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
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
