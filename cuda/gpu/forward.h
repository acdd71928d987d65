// CUDA forward pass (FlashAttention-2 design, mma.sync tensor cores, sm_80+).
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace jaxflash::gpu {

// Bytes of scratch the forward needs for these shapes: the persistent sm_90 kernel's tile
// counter (8 bytes) and the segment ids' per-tile ranges (segment_tiles.h). The Python side
// sizes the forward's last result (uint8) with it at abstract evaluation.
int64_t forward_workspace_bytes(int64_t num_instances, int64_t seqlen_q, int64_t seqlen_k, int64_t head_dim,
                                DType dtype, bool has_segment_ids);

// o and lse of `p` (see params.h), computed on `stream`; o in dtype, or in
// float32 with kOutputF32. `workspace` has forward_workspace_bytes(...) bytes
// (never 0), contents undefined on entry.
//   dtype f16 / bf16: fp16 / bf16 tensor-core MMAs, fp32 accumulation and softmax.
//   dtype f32: tf32 tensor-core MMAs (operands rounded to tf32), fp32 softmax;
//     with kExactF32, fp32-accurate products instead: 3xTF32 (each operand split
//     into big + small tf32 parts, three MMAs per product), about 3x the MMA work.
// Requires head_dim <= 256, T and S < 2^28, unit column stride for q, k, v
// and o, a bias in dtype or float32, and a workspace. Returns cudaErrorInvalidValue
// when a call breaks those, else cudaGetLastError() after the launch. Never allocates or
// synchronises (safe under CUDA-graph capture); empty problems launch nothing.
cudaError_t launch_forward(const AttentionParams& p, void* workspace, cudaStream_t stream);

#ifdef JAXFLASH_FWD_TIMELINE
// The sm_90 forward's per-CTA phase sums of the last launch (timeline.h): kTlCtas x
// kFtRowWords words on the device, allocated at the first launch (profiling builds only).
unsigned long long*& fwd_timeline_buffer();
#endif

}  // namespace jaxflash::gpu
