// Packed sequences (segment ids, params.h) in the CUDA general kernels: the id range
// (IdRange) of every query tile and key tile, computed once per call by a small kernel
// (segment_tile_ranges.h) into the call's scratch before the attention kernels run, so that
// a kernel can skip a (query tile, key tile) pair whose ranges do not meet (no pair of equal
// ids, nothing visible) with two uniform loads, and skip the per-element test where both
// tiles hold one and the same id.
// Tiles are those of the kernel that reads the table, aligned on multiples of their size, so
// every range is exact for the tile the kernel visits.
#pragma once

#include <cstdint>

#include "../params.h"

namespace jaxflash::gpu {

// A span of key tiles [lo, hi] (empty where lo > hi).
struct TileSpan {
  int32_t lo, hi;
};

// A backward producer's step at one Q tile (SegmentTiles::backward_step).
struct QTileStep {
  int64_t next;   // the next Q tile that may meet the key tile (> i_last: none)
  int turn;       // the key tile's dQ turn on this Q tile: meeting key tiles in the turn range
  bool id_test;   // whether the pair needs the per-element test
};

// The tables: [instance][tile] for each side; null without segment ids.
struct SegmentTiles {
  const IdRange* q = nullptr;
  const IdRange* k = nullptr;
  int64_t q_tiles = 0, k_tiles = 0;
  // [instance][query tile]: the first and last key tile whose range meets the query tile's
  // (the forward's walk, which then scans no tile outside them: under causal packing the
  // visible range reaches back to the row's first key); null where not asked for.
  const TileSpan* key_spans = nullptr;
  // The backward's key order check (launch_segment_tables): nonzero where some key tile
  // meets query tiles further apart than the launcher's limit; null where nothing was checked.
  const int* span_exceeded = nullptr;

  // Whether query tile i and key tile j of instance `linear` may hold a pair of equal ids
  // (always without segment ids).
  __device__ __forceinline__ bool may_meet(int64_t linear, int64_t i, int64_t j) const {
    return q == nullptr || q[linear * q_tiles + i].meets(k[linear * k_tiles + j]);
  }
  // Whether the pair needs the per-element test: ids present and not one id on both sides.
  __device__ __forceinline__ bool needs_test(int64_t linear, int64_t i, int64_t j) const {
    return q != nullptr && !q[linear * q_tiles + i].all_equal(k[linear * k_tiles + j]);
  }
  // The first query tile of [i, i_last] that may meet key tile j, i_last + 1 when none (i
  // without segment ids): the next Q tile a backward CTA visits. The whole warp calls it,
  // converged, and every lane gets the tile; 32 tiles per step, a ballot.
  __device__ __forceinline__ int64_t next_meeting_q_tile(int64_t linear, int64_t i, int64_t i_last, int64_t j,
                                                         int lane) const {
    if (q == nullptr) return i;
    const IdRange key = k[linear * k_tiles + j];
    const IdRange* queries = q + linear * q_tiles;
    for (; i <= i_last; i += 32) {
      const unsigned meets = __ballot_sync(0xffffffffu, i + lane <= i_last && queries[i + lane].meets(key));
      if (meets != 0) return i + __ffs(meets) - 1;
    }
    return i_last + 1;
  }
  // next_meeting_q_tile(i + 1), meeting_key_tiles(i, j0, j1) and needs_test(i, j) at once, for
  // Q tile i (<= i_last) of key tile j: lane l loads query tile i + l's range and key tile
  // j0 + l's together, so that a step inside a document (the next tile within 31, a turn range
  // within 32 tiles) takes one trip to L2 where the three took three dependent ones (the sm_90
  // backward's producer, whose per-tile chain bounded the kernel: bwd_sm90_loads.h). The whole
  // warp calls it, converged, and every lane gets the step.
  __device__ __forceinline__ QTileStep backward_step(int64_t linear, int64_t i, int64_t i_last, int64_t j,
                                                     int64_t j0, int64_t j1, int lane) const {
    if (q == nullptr) return {i + 1, static_cast<int>(j1 - j0), false};
    const IdRange key = k[linear * k_tiles + j];
    const IdRange* queries = q + linear * q_tiles;
    const IdRange* keys = k + linear * k_tiles;
    const bool q_in = i + lane <= i_last, k_in = j0 + lane < j1;
    const IdRange mine = q_in ? queries[i + lane] : IdRange{1, 0};
    const IdRange other = k_in ? keys[j0 + lane] : IdRange{1, 0};
    const IdRange query{__shfl_sync(0xffffffffu, mine.lo, 0), __shfl_sync(0xffffffffu, mine.hi, 0)};  // tile i's
    QTileStep step;
    step.id_test = !query.all_equal(key);
    step.turn = __popc(__ballot_sync(0xffffffffu, k_in && query.meets(other)));
    for (int64_t jj = j0 + 32; jj < j1; jj += 32)
      step.turn += __popc(__ballot_sync(0xffffffffu, jj + lane < j1 && query.meets(keys[jj + lane])));
    const unsigned later = __ballot_sync(0xffffffffu, lane > 0 && q_in && mine.meets(key));
    step.next = later != 0 ? i + __ffs(later) - 1 : next_meeting_q_tile(linear, i + 32, i_last, j, lane);
    return step;
  }
  // How many key tiles of [j0, j1) may meet query tile i (the backward's dQ turn, bwd_kernel.h;
  // all of them without segment ids); the whole warp calls it, converged, and every lane gets
  // the count.
  __device__ __forceinline__ int meeting_key_tiles(int64_t linear, int64_t i, int64_t j0, int64_t j1,
                                                   int lane) const {
    if (q == nullptr) return static_cast<int>(j1 - j0);
    const IdRange query = q[linear * q_tiles + i];
    const IdRange* keys = k + linear * k_tiles;
    int n = 0;
    for (int64_t j = j0; j < j1; j += 32) {
      const bool meets = j + lane < j1 && query.meets(keys[j + lane]);
      n += __popc(__ballot_sync(0xffffffffu, meets));
    }
    return n;
  }
};

// The tiles of `rows` rows that cover `length` positions.
inline int64_t segment_tile_count(int64_t length, int rows) { return (length + rows - 1) / rows; }

// The bytes one table of `tiles` entries of `entry` bytes per instance takes, rounded up to 256
// so that the next table starts 256-byte aligned.
inline int64_t segment_table_bytes(int64_t instances, int64_t tiles, int64_t entry = sizeof(IdRange)) {
  return (instances * tiles * entry + 255) / 256 * 256;
}

// Where the tables lie in the scratch, from its first 256-byte aligned byte: the query and key
// tiles' ranges, the query tiles' key spans, and the backward's span check word.
struct SegmentTablesLayout {
  int64_t q_tiles, k_tiles;
  int64_t k_off, spans_off, word_off, end;
  SegmentTablesLayout(int64_t instances, int64_t seqlen_q, int64_t seqlen_k, int q_rows, int k_rows)
      : q_tiles(segment_tile_count(seqlen_q, q_rows)), k_tiles(segment_tile_count(seqlen_k, k_rows)) {
    k_off = segment_table_bytes(instances, q_tiles);
    spans_off = k_off + segment_table_bytes(instances, k_tiles);
    word_off = spans_off + segment_table_bytes(instances, q_tiles, sizeof(TileSpan));
    end = word_off + 256;
  }
};

// The scratch the tables take (the first 256-byte aligned inside a buffer of any alignment,
// hence 256 bytes of slack); 0 without segment ids.
inline int64_t segment_tiles_bytes(bool has_segment_ids, int64_t instances, int64_t seqlen_q, int64_t seqlen_k,
                                   int q_rows, int k_rows) {
  if (!has_segment_ids) return 0;
  return 256 + SegmentTablesLayout(instances, seqlen_q, seqlen_k, q_rows, k_rows).end;
}

}  // namespace jaxflash::gpu
