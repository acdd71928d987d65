// The host's side of the sm_90 kernels' TMA loads: the driver's tensor map
// encoder and the descriptors of q-like operands, shared by forward.cu and
// backward.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "primitives/tma.h"
#include "../params.h"

namespace jaxflash::gpu {

// The driver's cuTensorMapEncodeTiled, through the runtime (no link against
// libcuda); null where the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encode;
}

// An sm_90 kernel's descriptor of a q-like operand (primitives/tma.h's
// TmaOperand: the forward's q, k, v, the backward's q, dO): `rows` rows of
// head_dim elements, boxes of 64 x box_rows with the 128-byte swizzle; rows past
// the tensor load as zeros. False where TMA cannot describe the layout (more than
// three instance axes that move the operand, strides not multiples of 16 bytes,
// more than 2^31 - 1 along an axis): the mma.sync kernel runs then, in both
// directions (forward.cu's choose_sm90, backward.cu's launch_backward).
inline bool encode_tma_operand(TmaOperand& out, const AttentionParams& p, const ArrayView& view, int64_t rows,
                               int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || view.data == nullptr || rows <= 0) return false;
  constexpr int64_t kElem = 2, kMaxCoord = (int64_t{1} << 31) - 1;
  cuuint64_t dims[5] = {static_cast<cuuint64_t>(p.head_dim), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[4] = {static_cast<cuuint64_t>(view.row_stride * kElem)};
  cuuint32_t box[5] = {64, static_cast<cuuint32_t>(box_rows), 1, 1, 1}, unit[5] = {1, 1, 1, 1, 1};
  if (view.row_stride <= 0 || (view.row_stride * kElem) % 16 != 0 || rows > kMaxCoord) return false;
  out.rank = 2;
  int64_t div = p.num_instances();
  for (int i = 0; i < 3; ++i) out.inst_div[i] = 1, out.inst_size[i] = 1;
  for (int d = 0; d < p.num_inst_dims; ++d) {
    div /= p.inst_size[d];  // the instances one step of axis d spans
    if (p.inst_size[d] <= 1 || view.inst_stride[d] == 0) continue;
    const int64_t bytes = view.inst_stride[d] * kElem;
    if (out.rank == 5 || bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t{1} << 40) || p.inst_size[d] > kMaxCoord)
      return false;
    out.inst_div[out.rank - 2] = div;
    out.inst_size[out.rank - 2] = p.inst_size[d];
    dims[out.rank] = static_cast<cuuint64_t>(p.inst_size[d]);
    strides[out.rank - 1] = static_cast<cuuint64_t>(bytes);
    ++out.rank;
  }
  const CUtensorMapDataType type = p.dtype == DType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(&out.map, type, static_cast<cuuint32_t>(out.rank), view.data, dims, strides, box, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace jaxflash::gpu
