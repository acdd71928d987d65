// Per-CTA view of one instance: its coordinates, decomposed once (64-bit
// divisions are slow, and params.h's instance_offset() would redo them for
// every operand), then dotted with each operand's instance strides. Same
// offsets as instance_offset(). Built once, before the main loop, and dropped:
// the few origins the kernel needs cost fewer registers than the coordinates.
#pragma once

#include <cstdint>

#include "../params.h"

namespace jaxflash::gpu {

struct InstanceIndex {
  int64_t coord[kMaxInstanceDims];

  // Unrolled over kMaxInstanceDims with a guard, so coord stays in registers. Index: int64_t,
  // or int where the caller's instance index is one (the sm_90 forward's tiles: fwd_schedule.h),
  // so that every size fits too and the divisions are 32-bit: a 64-bit one is a call of ~70
  // instructions, and the persistent forward decodes every tile (at N = 1k, ~5% of its warps'
  // stall samples were in this loop, Nsight Compute on the H200).
  template <class Index>
  __device__ __forceinline__ InstanceIndex(const AttentionParams& p, Index linear) {
#pragma unroll
    for (int d = kMaxInstanceDims - 1; d >= 0; --d) {
      coord[d] = 0;
      if (d < p.num_inst_dims) {
        const Index size = static_cast<Index>(p.inst_size[d]);
        const Index q = linear / size;
        coord[d] = linear - q * size;
        linear = q;
      }
    }
  }

  __device__ __forceinline__ int64_t offset(const AttentionParams& p, const ArrayView& view) const {
    int64_t off = 0;
#pragma unroll
    for (int d = 0; d < kMaxInstanceDims; ++d)
      if (d < p.num_inst_dims) off += coord[d] * view.inst_stride[d];
    return off;
  }

  template <class U>
  __device__ __forceinline__ U* origin(const AttentionParams& p, const ArrayView& view) const {
    return static_cast<U*>(view.data) + offset(p, view);
  }
};

// Whether every row of `view` starts on a `bytes` boundary (base, row stride and
// instance strides), so rows can move in chunks of that many bytes. Checked on
// the host at launch by both directions to pick their vectorised copies.
inline bool rows_aligned(const AttentionParams& p, const ArrayView& view, int elem_bytes, int bytes = 16) {
  const int64_t chunk = bytes / elem_bytes;
  if (reinterpret_cast<uintptr_t>(view.data) % bytes != 0 || view.row_stride % chunk != 0) return false;
  for (int d = 0; d < p.num_inst_dims; ++d)
    if (p.inst_size[d] > 1 && view.inst_stride[d] % chunk != 0) return false;
  return true;
}

}  // namespace jaxflash::gpu
