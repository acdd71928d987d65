// Which (instance, query tile) each forward tile index names: the order both
// forward kernels share (fwd_kernel.h: one CTA per index; fwd_sm90_kernel.h:
// persistent CTAs that take the indices in turn, next_persistent_tile).
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
  int linear;  // the instance
  int m0;      // its first query row
};

// In 32 bits: the launchers keep the tile count, and so the instances and a
// group's tiles, within INT_MAX (fwd_launch.h), and 64-bit divisions are long
// code in the persistent kernel's loop over tiles, whose producer has 24 registers.
template <int kBlockM>
__device__ __forceinline__ FwdTile forward_tile(const AttentionParams& p, const FwdRuntime& rt, int block) {
  const int instances = rt.instances, group_size = static_cast<int>(rt.tile_group);
  const int num_m = (static_cast<int>(p.seqlen_q) + kBlockM - 1) / kBlockM;
  const int group_blocks = group_size * num_m;
  const int group = block / group_blocks;
  const int first = group * group_size, r = block - group * group_blocks;
  const int in_group = min(group_size, instances - first);
  return {first + r % in_group, (num_m - 1 - r / in_group) * kBlockM};
}

// The persistent grid's next tile index: each CTA starts at its blockIdx.x and
// then takes the next index not yet taken (rt.tile_counter, zeroed before the
// launch), so the tiles start in the order above, longest first under causal
// masking, each on the CTA that is free first (the balance the hardware gives
// one CTA per tile). Indices >= rt.tiles: no tile left.
__device__ __forceinline__ int next_persistent_tile(const FwdRuntime& rt) {
  return static_cast<int>(gridDim.x + atomicAdd(rt.tile_counter, 1u));
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
