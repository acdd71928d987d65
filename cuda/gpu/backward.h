// CUDA backward pass (FlashAttention-2 algebra, mma.sync tensor cores, sm_80+).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../params.h"

namespace jaxflash::gpu {

// Bytes of scratch the backward needs for p's shapes (fp32 dQ accumulator, per-row
// lse / delta, per-(instance, Q tile) semaphores, a CTA ticket counter, segment ids'
// per-tile ranges). A pure function of (instances = p.num_instances(), seqlen_q,
// seqlen_k, head_dim, dtype, kHasSegmentIds);
// the Python side sizes an extra uint8 output with it at abstract evaluation.
// Includes 256 bytes of slack so any base alignment of the buffer works.
int64_t backward_workspace_bytes(int64_t num_instances, int64_t seqlen_q, int64_t seqlen_k, int64_t head_dim,
                                 DType dtype, bool has_segment_ids);

// dq, dk, dv (+ dbias when kHasDbias) from q, k, v, lse, d_o and delta (+ bias,
// mask, lengths), on `stream`; delta is float32 per query row, rowsum(dO o O) -
// dlse, computed by XLA from the float32 output. `workspace` has
// backward_workspace_bytes(...) bytes, contents undefined on entry. Bitwise deterministic (no order-dependent
// float reductions). Never allocates or synchronises (CUDA-graph safe).
//   dtype f16 / bf16: fp16 / bf16 tensor-core MMAs, fp32 accumulation.
//   dtype f32: tf32 tensor-core MMAs (operands rounded to tf32), fp32 elsewhere;
//     with kExactF32, fp32-accurate products instead: 3xTF32 (each operand split
//     into big + small tf32 parts, three MMAs per product), about 3x the MMA work.
// Requires head_dim <= 256; unit column stride for q, k, v, d_o, dq, dk, dv;
// a bias in dtype or float32; dq unshared along every instance axis; dk and dv
// shared along the same axes; a bias when dbias is asked for. Returns
// cudaErrorInvalidValue (with nothing launched) otherwise, else
// cudaGetLastError() after the launches.
cudaError_t launch_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

#ifdef JAXFLASH_BWD_TIMELINE
// The sm_90 backward's event times of the last launch (timeline.h): kTlCtas x kTlEvents
// stamps on the device, allocated at the first launch (profiling builds only).
unsigned long long*& bwd_timeline_buffer();
#endif

}  // namespace jaxflash::gpu
