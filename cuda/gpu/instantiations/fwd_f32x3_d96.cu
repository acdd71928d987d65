// Forward kernel for dtype f32 with kExactF32 (3xTF32 MMAs), padded head dim
// 96: one translation unit per pair so the builds run in parallel.
#include "../fwd_launch.h"

namespace jaxflash::gpu {
template cudaError_t launch_forward_instance<float, 96, F32Mma::k3xTf32>(const AttentionParams&, const FwdRuntime&,
                                                                        cudaStream_t);
}  // namespace jaxflash::gpu
