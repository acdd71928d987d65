// Per-CTA event times of the sm_90 backward, for profiling only: compiled in
// with -DJAXFLASH_BWD_TIMELINE (scripts/profile_kernel.sh bwd D N causal|full
// timeline), absent otherwise. Each CTA stamps the GPU's global timer (ns) at
// the events below into its row of a device buffer that backward.cu allocates
// (bwd_timeline_buffer); bwd_selftest's bench prints where a CTA's life goes
// (loads, Q-tile loop, dK / dV epilogue, the dQ writer's drain) and the SMs'
// idle gaps between CTAs. Nsight Compute samples stalls by source line, but
// cannot say how long a CTA spends before its first product or after its last,
// which is what the grid of one CTA per key tile pays for and a persistent
// kernel would hide.
#pragma once

namespace jaxflash::gpu {

enum BwdTimelineEvent : int {
  kTlStart = 0,       // thread 0, before the ticket
  kTlKvIssue = 1,     // consumer 0: about to copy the first K / V tile (ticket, setup done)
  kTlKvLoaded = 2,    // consumer 0: the first K / V tile in shared memory
  kTlFirstQ = 3,      // consumer 0: the first Q tile's stage has landed
  kTlLoopDone = 4,    // consumer 0: its last Q tile handed to the writer
  kTlEpiSynced = 5,   // consumer 0: both warpgroups at the epilogue's first barrier
  kTlEpiStaged = 6,   // consumer 0: dK / dV staged in shared memory
  kTlEpiStored = 7,   // consumer 0: its dK / dV stores issued
  kTlWriterDone = 8,  // the dQ writer: its last turn signalled
  kTlSm = 9,          // value: the SM's id
  kTlEvents = 16,     // a CTA's row
  kTlCtas = 8192,     // rows: CTAs past these wrap
};

#ifdef JAXFLASH_BWD_TIMELINE
__device__ __forceinline__ unsigned long long timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#define JF_TIMELINE(rt, event, value) \
  ((rt).timeline[(blockIdx.x % ::jaxflash::gpu::kTlCtas) * ::jaxflash::gpu::kTlEvents + (event)] = (value))
#define JF_TIMELINE_NOW(rt, event) JF_TIMELINE(rt, event, ::jaxflash::gpu::timeline_now())
#else
#define JF_TIMELINE(rt, event, value) ((void)0)
#define JF_TIMELINE_NOW(rt, event) ((void)0)
#endif

}  // namespace jaxflash::gpu
