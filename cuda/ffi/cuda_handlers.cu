// XLA FFI handlers of the CUDA kernels: decode (cuda/ffi/decode.h, shared with
// the CPU handlers), then launch on XLA's stream. They allocate nothing and
// never synchronise, so XLA may capture them in CUDA graphs.
#include <string>

#include <cuda_runtime.h>

#include "cuda/ffi/decode.h"
#include "cuda/ffi/handlers.h"
#include "cuda/gpu/backward.h"
#include "cuda/gpu/forward.h"

namespace jaxflash {
namespace {

ffi::Error launch_status(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  if (status == cudaErrorInvalidValue)
    return ffi::Error::InvalidArgument(std::string("jaxflash: the CUDA ") + what +
                                       " kernel does not support this call (see docs/DESIGN.md)");
  if (status == cudaErrorNoKernelImageForDevice)
    return ffi::Error::Internal(std::string("jaxflash: this build's CUDA kernels are for ") +
                                JAXFLASH_CUDA_ARCHITECTURES + ", not for this GPU: reinstall jaxflash on a machine "
                                "that sees this GPU, or with JAXFLASH_CUDA_ARCHITECTURES naming its architecture");
  return ffi::Error::Internal(std::string("jaxflash: CUDA ") + what + " launch failed: " +
                              cudaGetErrorString(status));
}

// What the CUDA kernels do not take (params.h): a value head dim other than the query/key one
// (they size every tile by one head dim). jaxflash's CUDA lowering never sends it: it zero-pads
// the narrower operands to one head dim around the call and slices the results
// (kernels.call_with_one_head_dim). This refuses it for any other caller, so that no kernel reads
// v, o, d_o and dv with the wrong row length.
ffi::Error refuse_cpu_only(const AttentionParams& p) {
  if (p.value_head_dim != p.head_dim)
    return ffi::Error::InvalidArgument(
        "jaxflash: the CUDA kernels take one head dim: the value head dim (" + std::to_string(p.value_head_dim) +
        ") must equal the query/key head dim (" + std::to_string(p.head_dim) +
        "); jaxflash's CUDA lowering zero-pads the narrower operands to one head dim before the call "
        "(jaxflash/kernels.py, call_with_one_head_dim)");
  return ffi::Error::Success();
}

ffi::Error forward_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                        ffi::AnyBuffer seed, ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                        ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer scale,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                        ffi::Result<ffi::AnyBuffer> workspace, LayoutAttrs attrs) {
  AttentionParams p;
  if (auto e = decode_forward(
          p, {q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, alibi_slopes, scale}, *o,
          *lse, attrs);
      e.failure())
    return e;
  if (auto e = refuse_cpu_only(p); e.failure()) return e;
  const int64_t needed = gpu::forward_workspace_bytes(p.num_instances(), p.seqlen_q, p.seqlen_k, p.head_dim,
                                                      p.dtype, p.has(kHasSegmentIds));
  if (static_cast<int64_t>(workspace->size_bytes()) < needed)
    return ffi::Error::InvalidArgument("jaxflash: forward workspace is too small");
  return launch_status(gpu::launch_forward(p, workspace->untyped_data(), stream), "forward");
}

ffi::Error backward_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                         ffi::AnyBuffer seed, ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                         ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer scale,
                         ffi::AnyBuffer lse, ffi::AnyBuffer delta, ffi::AnyBuffer d_o, ffi::AnyBuffer dscale_centre,
                         ffi::AnyBuffer dalibi_centre,
                         ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                         ffi::Result<ffi::AnyBuffer> dalibi, ffi::Result<ffi::AnyBuffer> dscale,
                         ffi::Result<ffi::AnyBuffer> workspace, LayoutAttrs attrs) {
  AttentionParams p;
  if (auto e = decode_backward(
          p, {q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, alibi_slopes, scale}, lse,
          delta, d_o, dscale_centre, dalibi_centre, *dq, *dk, *dv, *dbias, *dalibi, *dscale, attrs);
      e.failure())
    return e;
  if (auto e = refuse_cpu_only(p); e.failure()) return e;
  const int64_t needed = gpu::backward_workspace_bytes(p.num_instances(), p.seqlen_q, p.seqlen_k, p.head_dim,
                                                       p.dtype, p.has(kHasSegmentIds));
  if (static_cast<int64_t>(workspace->size_bytes()) < needed)
    return ffi::Error::InvalidArgument("jaxflash: backward workspace is too small");
  return launch_status(gpu::launch_backward(p, workspace->untyped_data(), stream), "backward");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_forward_cuda, forward_cuda,
                              bind_forward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_backward_cuda, backward_cuda,
                              bind_backward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxflash
