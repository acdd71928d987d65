// Backward kernels (main + dbias) for dtype bf16, padded head dim 96: one
// translation unit per pair so the builds run in parallel.
#include "../bwd_launch.h"

namespace jaxflash::gpu {
template cudaError_t launch_backward_instance<__nv_bfloat16, 96>(const AttentionParams&, const BwdRuntime&, cudaStream_t);
}  // namespace jaxflash::gpu
