// Backward kernels (main + dbias) for dtype bf16, padded head dim 192: one
// translation unit per pair so the builds run in parallel.
#include "../bwd_launch.h"

namespace jaxflash::gpu {
template cudaError_t launch_backward_instance<__nv_bfloat16, 192>(const AttentionParams&, const BwdRuntime&, cudaStream_t);
}  // namespace jaxflash::gpu
