// Backward kernels (main + dbias) for dtype f32 with kExactF32 (3xTF32 MMAs),
// padded head dim 256: one translation unit per pair so the builds run in parallel.
#include "../bwd_launch.h"

namespace jaxflash::gpu {
template cudaError_t launch_backward_instance<float, 256, F32Mma::k3xTf32>(const AttentionParams&, const BwdRuntime&,
                                                                         cudaStream_t);
}  // namespace jaxflash::gpu
