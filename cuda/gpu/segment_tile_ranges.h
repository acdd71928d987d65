// The kernel that fills the segment ids' per-tile range tables (segment_tiles.h), and its
// launch. Included by the launchers (forward.cu, backward.cu) only, so that the kernel
// instance translation units, which read the tables, do not carry it.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "segment_tiles.h"
#include "../params.h"

namespace jaxflash::gpu {

constexpr int kSegmentWarps = 8;  // tiles (one warp each) per CTA of segment_tile_ranges

// One warp per (instance, tile) of one side (kKeys: the key/value ids): the min and max id
// of the tile's rows, padding rows past the lengths included (a superset of the visible
// rows' range, and the same one for every kernel that reads the table).
template <bool kKeys>
__global__ void __launch_bounds__(32 * kSegmentWarps)
    segment_tile_ranges(const __grid_constant__ AttentionParams p, int tile_rows, int64_t tiles, IdRange* out) {
  const int lane = threadIdx.x % 32;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kSegmentWarps + threadIdx.x / 32;
  if (w >= p.num_instances() * tiles) return;
  const int64_t linear = w / tiles, tile = w - linear * tiles;
  const ArrayView& ids = kKeys ? p.kv_segment_ids : p.q_segment_ids;
  const int64_t length = kKeys ? p.seqlen_k : p.seqlen_q;
  const int32_t* base = static_cast<const int32_t*>(ids.data) + instance_offset(p, ids, linear);
  const int64_t first = tile * tile_rows, end = min(length, first + tile_rows);
  int32_t lo = INT_MAX, hi = INT_MIN;
  for (int64_t r = first + lane; r < end; r += 32) {
    const int32_t id = __ldg(base + r * ids.row_stride);
    lo = min(lo, id);
    hi = max(hi, id);
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, m));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, m));
  }
  if (lane == 0) out[w] = IdRange{lo, hi};
}

// Fills both tables in `scratch` (segment_tiles_bytes(...) bytes) for tiles of q_rows
// queries and k_rows keys, on `stream`, and points `tiles` at them; without segment ids
// leaves `tiles` null and launches nothing.
inline cudaError_t launch_segment_tile_ranges(const AttentionParams& p, int q_rows, int k_rows, void* scratch,
                                              SegmentTiles& tiles, cudaStream_t stream) {
  tiles = SegmentTiles{};
  if (!p.has(kHasSegmentIds) || p.seqlen_q == 0 || p.seqlen_k == 0) return cudaSuccess;
  if (scratch == nullptr || p.q_segment_ids.data == nullptr || p.kv_segment_ids.data == nullptr)
    return cudaErrorInvalidValue;
  const int64_t instances = p.num_instances();
  tiles.q_tiles = segment_tile_count(p.seqlen_q, q_rows);
  tiles.k_tiles = segment_tile_count(p.seqlen_k, k_rows);
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 255) / 256 * 256);
  IdRange* q = reinterpret_cast<IdRange*>(base);
  IdRange* k = reinterpret_cast<IdRange*>(base + segment_table_bytes(instances, tiles.q_tiles));
  tiles.q = q, tiles.k = k;
  const int64_t q_blocks = (instances * tiles.q_tiles + kSegmentWarps - 1) / kSegmentWarps;
  const int64_t k_blocks = (instances * tiles.k_tiles + kSegmentWarps - 1) / kSegmentWarps;
  if (q_blocks > INT_MAX || k_blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  segment_tile_ranges<false><<<static_cast<unsigned>(q_blocks), 32 * kSegmentWarps, 0, stream>>>(p, q_rows,
                                                                                                 tiles.q_tiles, q);
  segment_tile_ranges<true><<<static_cast<unsigned>(k_blocks), 32 * kSegmentWarps, 0, stream>>>(p, k_rows,
                                                                                                tiles.k_tiles, k);
  return cudaGetLastError();
}

}  // namespace jaxflash::gpu
