// Validation, launch-time constants and the (dtype, head dim) dispatch of the
// forward pass. The kernels themselves are instantiated in generated
// translation units (cmake/cuda.cmake).
#include "forward.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "instance.h"
#include "kernel_traits.h"
#include "primitives/positions.h"

namespace jaxflash::gpu {

// Defined in the generated fwd_<dtype>_d<D>.cu (3xTF32: fwd_f32x3_d<D>.cu; cmake/cuda.cmake).
template <class T, int D, F32Mma M = F32Mma::kTf32>
cudaError_t launch_forward_instance(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream);

namespace {

template <class T, F32Mma M = F32Mma::kTf32>
cudaError_t dispatch_head_dim(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  const int64_t h = p.head_dim;
  if (h <= 32) return launch_forward_instance<T, 32, M>(p, rt, stream);
  if (h <= 64) return launch_forward_instance<T, 64, M>(p, rt, stream);
  if (h <= 96) return launch_forward_instance<T, 96, M>(p, rt, stream);
  if (h <= 128) return launch_forward_instance<T, 128, M>(p, rt, stream);
  if (h <= 192) return launch_forward_instance<T, 192, M>(p, rt, stream);
  return launch_forward_instance<T, 256, M>(p, rt, stream);
}

}  // namespace

cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream) {
  const int elem_bytes = dtype_bytes(p.dtype);
  if (elem_bytes == 0) return cudaErrorInvalidValue;
  // Positions are 32-bit in the kernel (see primitives/positions.h).
  if (p.head_dim < 0 || p.head_dim > 256 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.seqlen_q >= kMaxSeqLen ||
      p.seqlen_k >= kMaxSeqLen || p.diagonal_offset <= -kMaxSeqLen || p.diagonal_offset >= kMaxSeqLen)
    return cudaErrorInvalidValue;
  if (p.seqlen_q == 0 || p.num_instances() == 0) return cudaSuccess;  // nothing to write
  // The kernel copies rows of q/k/v/o in contiguous chunks.
  if (p.head_dim > 1 && (p.q.col_stride != 1 || p.k.col_stride != 1 || p.v.col_stride != 1 || p.o.col_stride != 1))
    return cudaErrorInvalidValue;
  const bool has_bias = p.has(kHasBias), has_mask = p.has(kHasMask);
  if (has_bias && p.bias_dtype != p.dtype && p.bias_dtype != DType::kF32) return cudaErrorInvalidValue;
  // A flagged operand must be there whenever it could be read (zero-size
  // buffers arrive as null, and then nothing reads them).
  const bool any_key = p.seqlen_k > 0;
  if ((has_bias && any_key && p.bias.data == nullptr) || (has_mask && any_key && p.mask.data == nullptr) ||
      (p.has(kDropout) && p.seed.data == nullptr) ||
      (p.has(kHasQLens) && p.q_lens.data == nullptr) || (p.has(kHasKvLens) && p.kv_lens.data == nullptr))
    return cudaErrorInvalidValue;

  constexpr float kLog2e = 1.4426950408889634f;
  FwdRuntime rt;
  rt.score_mul = p.scale * kLog2e;
  // The unfolded path takes the running max of raw scores, which commutes
  // with the scaling only for scale > 0.
  rt.fold_scale = has_bias || !(p.scale > 0.f);
  rt.exp_scale = rt.fold_scale ? 1.f : rt.score_mul;
  rt.p_shift = p.dtype == DType::kF16 ? 0.f : probability_shift(p.seqlen_k);
  rt.out_scale = p.has(kDropout) ? p.keep_scale : 1.f;
  rt.bias_f32 = p.bias_dtype == DType::kF32;
  rt.q_vec = rows_aligned(p, p.q, elem_bytes);
  rt.k_vec = rows_aligned(p, p.k, elem_bytes);
  rt.v_vec = rows_aligned(p, p.v, elem_bytes);
  rt.o_vec = rows_aligned(p, p.o, p.has(kOutputF32) ? 4 : elem_bytes);
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&rt.sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;

  switch (p.dtype) {
    case DType::kF16: return dispatch_head_dim<__half>(p, rt, stream);
    case DType::kBF16: return dispatch_head_dim<__nv_bfloat16>(p, rt, stream);
    default:  // kF32 (dtype_bytes checked it)
      return p.has(kExactF32) ? dispatch_head_dim<float, F32Mma::k3xTf32>(p, rt, stream)
                              : dispatch_head_dim<float>(p, rt, stream);
  }
}

}  // namespace jaxflash::gpu
