// Forward kernel for dtype bf16, padded head dim 128: one translation unit per
// pair so the builds run in parallel.
#include "../fwd_launch.h"

namespace jaxflash::gpu {
template cudaError_t launch_forward_instance<__nv_bfloat16, 128>(const AttentionParams&, const FwdRuntime&, cudaStream_t);
}  // namespace jaxflash::gpu
