// Which (instance, query tile) each forward CTA computes: the grid order both
// forward kernels (fwd_kernel.h, fwd_sm90_kernel.h) share.
//
// A flat 1-D grid (instances can exceed gridDim.y's 65535) in groups of
// rt.tile_group instances; inside a group the instance runs fastest and the
// query tiles go last-first. Under causal masking the last tile has the most
// keys: longest first, so the short tiles fill the tail of the group instead
// of a long one running on alone (with the instance slowest, a group of one,
// the last instances' long tiles started late: causal 16k ran ~15% below
// full). Groups keep the K/V that the CTAs in flight read within L2's reach
// (the launchers size them: FwdRuntime::tile_group).
#pragma once

#include <cstdint>

#include "kernel_traits.h"
#include "../params.h"

namespace jaxflash::gpu {

struct FwdTile {
  int64_t linear;  // the instance
  int m0;          // its first query row
};

template <int kBlockM>
__device__ __forceinline__ FwdTile forward_tile(const AttentionParams& p, const FwdRuntime& rt, int64_t block) {
  const int64_t instances = p.num_instances();
  const int num_m = static_cast<int>((p.seqlen_q + kBlockM - 1) / kBlockM);
  const int64_t group_blocks = rt.tile_group * num_m;
  const int64_t group = block / group_blocks;
  const int64_t first = group * rt.tile_group, r = block - group * group_blocks;
  const int64_t in_group = min(rt.tile_group, instances - first);
  return {first + r % in_group, (num_m - 1 - static_cast<int>(r / in_group)) * kBlockM};
}

// Instances per group: enough that a group's work per CTA slot exceeds its
// longest query tile, few enough that their K/V stay near L2's size:
// ceil(4 SMs / query tiles), so a group is ~4 CTAs per SM (2 resident, tiles
// averaging half the longest under causal masking).
inline int64_t forward_tile_group(const AttentionParams& p, int sms, int64_t num_m) {
  const int64_t group = (4 * int64_t{sms} + num_m - 1) / num_m;
  const int64_t instances = p.num_instances();
  return group < 1 ? 1 : (group > instances ? instances : group);
}

}  // namespace jaxflash::gpu
