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
// The span check (span_exceeded not null): the query side's first thread zeroes the word, and
// the key side, launched after the query table is complete, sets it where a key tile's range
// meets query tiles (of `q_table`) more than max_q_span apart, first to last.
template <bool kKeys>
__global__ void __launch_bounds__(32 * kSegmentWarps)
    segment_tile_ranges(const __grid_constant__ AttentionParams p, int tile_rows, int64_t tiles, IdRange* out,
                        const IdRange* q_table, int64_t q_tiles, int64_t max_q_span, int* span_exceeded) {
  const int lane = threadIdx.x % 32;
  if (!kKeys && span_exceeded != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *span_exceeded = 0;
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
  if (kKeys && span_exceeded != nullptr) {
    const IdRange key{lo, hi};
    const IdRange* queries = q_table + linear * q_tiles;
    int64_t first_met = -1, last_met = -1;
    for (int64_t i = 0; i < q_tiles; i += 32) {
      const unsigned met = __ballot_sync(0xffffffffu, i + lane < q_tiles && queries[i + lane].meets(key));
      if (met == 0) continue;
      if (first_met < 0) first_met = i + __ffs(met) - 1;
      last_met = i + 31 - __clz(met);
    }
    if (lane == 0 && first_met >= 0 && last_met - first_met + 1 > max_q_span) atomicOr(span_exceeded, 1);
  }
}

// Fills both range tables in `scratch` (segment_tiles_bytes(...) bytes) for tiles of q_rows
// queries and k_rows keys, on `stream`, and points `tiles` at them; without segment ids leaves
// `tiles` null and launches nothing. key_spans: also points `tiles` at the query tiles' key
// spans' table, which the forward fills (forward.cu's segment_key_spans).
// max_q_span >= 0: also the span check above, whose word `tiles.span_exceeded` points at.
inline cudaError_t launch_segment_tile_ranges(const AttentionParams& p, int q_rows, int k_rows, void* scratch,
                                              SegmentTiles& tiles, cudaStream_t stream, bool key_spans,
                                              int64_t max_q_span = -1) {
  tiles = SegmentTiles{};
  if (!p.has(kHasSegmentIds) || p.seqlen_q == 0 || p.seqlen_k == 0) return cudaSuccess;
  if (scratch == nullptr || p.q_segment_ids.data == nullptr || p.kv_segment_ids.data == nullptr)
    return cudaErrorInvalidValue;
  const int64_t instances = p.num_instances();
  const SegmentTablesLayout layout(instances, p.seqlen_q, p.seqlen_k, q_rows, k_rows);
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 255) / 256 * 256);
  IdRange* q = reinterpret_cast<IdRange*>(base);
  IdRange* k = reinterpret_cast<IdRange*>(base + layout.k_off);
  TileSpan* spans = key_spans ? reinterpret_cast<TileSpan*>(base + layout.spans_off) : nullptr;
  int* span_exceeded = max_q_span < 0 ? nullptr : reinterpret_cast<int*>(base + layout.word_off);
  tiles.q = q, tiles.k = k, tiles.key_spans = spans, tiles.span_exceeded = span_exceeded;
  tiles.q_tiles = layout.q_tiles, tiles.k_tiles = layout.k_tiles;
  const int64_t q_blocks = (instances * tiles.q_tiles + kSegmentWarps - 1) / kSegmentWarps;
  const int64_t k_blocks = (instances * tiles.k_tiles + kSegmentWarps - 1) / kSegmentWarps;
  if (q_blocks > INT_MAX || k_blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  segment_tile_ranges<false><<<static_cast<unsigned>(q_blocks), 32 * kSegmentWarps, 0, stream>>>(
      p, q_rows, tiles.q_tiles, q, nullptr, 0, max_q_span, span_exceeded);
  segment_tile_ranges<true><<<static_cast<unsigned>(k_blocks), 32 * kSegmentWarps, 0, stream>>>(
      p, k_rows, tiles.k_tiles, k, q, tiles.q_tiles, max_q_span, span_exceeded);
  return cudaGetLastError();
}

}  // namespace jaxflash::gpu
