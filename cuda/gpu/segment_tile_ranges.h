// The kernel that fills the segment ids' per-tile tables (segment_tiles.h) in one launch, and
// its launch. Included by the launchers (forward.cu, backward.cu) only, so that the kernel
// instance translation units, which read the tables, do not carry it.
//
// One launch: it was three (the query tiles' ranges, the key tiles' ranges, then the forward's
// key spans or the backward's span check, which read both or the query table), each a few
// microseconds that were mostly launch and drain: ~11 us of the packed forward's ~230
// (H200, 16 documents of 1k, D = 128, session 18's Nsight figures). The later stages wait
// inside the kernel for the earlier ones, and cannot deadlock: every CTA takes its task from a
// counter in claim order, the range tasks first, so a CTA waits only for tasks that CTAs
// already running took, and those wait for nothing (the query ranges) or only for the query
// ranges.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "segment_tiles.h"
#include "../params.h"

namespace jaxflash::gpu {

constexpr int kSegmentWarps = 8;  // tiles (one warp each) per CTA of segment_tables

// The table kernel's counters, zeroed on the stream before its launch (by the launcher that
// owns the workspace): the CTAs' claims, and the CTAs done with the query and the key ranges.
struct SegmentTableCounters {
  unsigned claimed, q_done, k_done;
};

// One launch's tasks: CTAs [0, q_ctas) the query tiles' ranges, the next k_ctas the key
// tiles', the rest (where `spans` is set) the query tiles' key spans, kSegmentWarps tiles (one
// per warp) each.
struct SegmentTableJob {
  IdRange* q;
  IdRange* k;
  TileSpan* spans;     // null: no spans
  int* span_exceeded;  // null: no span check
  SegmentTableCounters* counters;
  int64_t q_tiles, k_tiles, max_q_span;
  int q_rows, k_rows;
  unsigned q_ctas, k_ctas;
};

namespace segment_tables_detail {

// A warp's range of one tile: the min and max id of the tile's rows, padding rows past the
// lengths included (a superset of the visible rows' range, and the same one for every kernel
// that reads the table). Every lane gets it.
__device__ __forceinline__ IdRange tile_range(const AttentionParams& p, const ArrayView& ids, int64_t length,
                                              int64_t linear, int64_t tile, int tile_rows, int lane) {
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
  return {lo, hi};
}

// The CTA's tables are written: one arrival on `done` (cooperative groups' grid barrier's
// order: the CTA's writes, a CTA barrier, then its first thread's fence and atomic).
__device__ __forceinline__ void signal(unsigned* done) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(done, 1u);
  }
}

// Until `count` CTAs arrived on `done`; the tables they wrote are then read through L2
// (__ldcg: no L1 line of this SM predates them).
__device__ __forceinline__ void wait_for(const unsigned* done, unsigned count) {
  if (threadIdx.x == 0) {
    unsigned seen;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(done) : "memory");
      if (seen >= count) break;
      __nanosleep(64);
    }
  }
  __syncthreads();
}

__device__ __forceinline__ IdRange load_range(const IdRange* at) {
  const int2 v = __ldcg(reinterpret_cast<const int2*>(at));
  return {v.x, v.y};
}

}  // namespace segment_tables_detail

// (A template, as the kernels in headers are: forward.cu and backward.cu both instantiate it.)
template <int kWarps>
__global__ void __launch_bounds__(32 * kWarps)
    segment_tables(const __grid_constant__ AttentionParams p, const __grid_constant__ SegmentTableJob job) {
  using namespace segment_tables_detail;
  __shared__ unsigned claim;
  if (threadIdx.x == 0) claim = atomicAdd(&job.counters->claimed, 1u);
  __syncthreads();
  const unsigned cta = claim;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t instances = p.num_instances();
  if (cta < job.q_ctas) {  // the query tiles' ranges
    if (job.span_exceeded != nullptr && cta == 0 && threadIdx.x == 0) *job.span_exceeded = 0;
    const int64_t w = static_cast<int64_t>(cta) * kWarps + warp;
    if (w < instances * job.q_tiles) {
      const int64_t linear = w / job.q_tiles;
      const IdRange r = tile_range(p, p.q_segment_ids, p.seqlen_q, linear, w - linear * job.q_tiles, job.q_rows, lane);
      if (lane == 0) job.q[w] = r;
    }
    signal(&job.counters->q_done);
  } else if (cta < job.q_ctas + job.k_ctas) {  // the key tiles' ranges (and the span check)
    const int64_t w = static_cast<int64_t>(cta - job.q_ctas) * kWarps + warp;
    const bool in = w < instances * job.k_tiles;
    const int64_t linear = in ? w / job.k_tiles : 0;
    IdRange key{};
    if (in) {
      key = tile_range(p, p.kv_segment_ids, p.seqlen_k, linear, w - linear * job.k_tiles, job.k_rows, lane);
      if (lane == 0) job.k[w] = key;
    }
    signal(&job.counters->k_done);
    // The backward's span check: set where the key tile meets query tiles more than max_q_span
    // apart, first to last.
    if (job.span_exceeded != nullptr) {
      wait_for(&job.counters->q_done, job.q_ctas);
      if (in) {
        const IdRange* queries = job.q + linear * job.q_tiles;
        int64_t first_met = -1, last_met = -1;
        for (int64_t i = 0; i < job.q_tiles; i += 32) {
          const bool met = i + lane < job.q_tiles && load_range(queries + i + lane).meets(key);
          const unsigned ballot = __ballot_sync(0xffffffffu, met);
          if (ballot == 0) continue;
          if (first_met < 0) first_met = i + __ffs(ballot) - 1;
          last_met = i + 31 - __clz(ballot);
        }
        if (lane == 0 && first_met >= 0 && last_met - first_met + 1 > job.max_q_span) atomicOr(job.span_exceeded, 1);
      }
    }
  } else {  // the forward's key spans
    wait_for(&job.counters->q_done, job.q_ctas);
    wait_for(&job.counters->k_done, job.k_ctas);
    // The first and the last key tile whose range meets the query tile's ({k_tiles, -1} when
    // none), each a ballot over 32 key tiles at a time from its end of the row, stopping at
    // the first that meets.
    const int64_t w = static_cast<int64_t>(cta - job.q_ctas - job.k_ctas) * kWarps + warp;
    if (w >= instances * job.q_tiles) return;
    const int64_t linear = w / job.q_tiles, k_tiles = job.k_tiles;
    const IdRange query = load_range(job.q + w);
    const IdRange* keys = job.k + linear * k_tiles;
    TileSpan span{static_cast<int32_t>(k_tiles), -1};
    for (int64_t j = 0; j < k_tiles; j += 32) {
      const unsigned met = __ballot_sync(0xffffffffu, j + lane < k_tiles && load_range(keys + j + lane).meets(query));
      if (met != 0) {
        span.lo = static_cast<int32_t>(j + __ffs(met) - 1);
        break;
      }
    }
    for (int64_t j = k_tiles - 1; j >= span.lo; j -= 32) {  // (none met: no pass)
      const unsigned met = __ballot_sync(0xffffffffu, j - lane >= 0 && load_range(keys + j - lane).meets(query));
      if (met != 0) {
        span.hi = static_cast<int32_t>(j - (__ffs(met) - 1));
        break;
      }
    }
    if (lane == 0) job.spans[w] = span;
  }
}

// Fills the tables in `scratch` (segment_tiles_bytes(...) bytes) for tiles of q_rows queries
// and k_rows keys, on `stream`, and points `tiles` at them; without segment ids leaves `tiles`
// null and launches nothing. `counters` must be zero on the stream (the caller's memset).
// key_spans: also the query tiles' key spans (the sm_90 forward's walk). max_q_span >= 0: also
// the backward's span check, whose word `tiles.span_exceeded` points at.
inline cudaError_t launch_segment_tables(const AttentionParams& p, int q_rows, int k_rows, void* scratch,
                                         SegmentTableCounters* counters, SegmentTiles& tiles, cudaStream_t stream,
                                         bool key_spans, int64_t max_q_span = -1) {
  tiles = SegmentTiles{};
  if (!p.has(kHasSegmentIds) || p.seqlen_q == 0 || p.seqlen_k == 0) return cudaSuccess;
  if (scratch == nullptr || counters == nullptr || p.q_segment_ids.data == nullptr ||
      p.kv_segment_ids.data == nullptr)
    return cudaErrorInvalidValue;
  const int64_t instances = p.num_instances();
  const SegmentTablesLayout layout(instances, p.seqlen_q, p.seqlen_k, q_rows, k_rows);
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 255) / 256 * 256);
  SegmentTableJob job{};
  job.q = reinterpret_cast<IdRange*>(base);
  job.k = reinterpret_cast<IdRange*>(base + layout.k_off);
  job.spans = key_spans ? reinterpret_cast<TileSpan*>(base + layout.spans_off) : nullptr;
  job.span_exceeded = max_q_span < 0 ? nullptr : reinterpret_cast<int*>(base + layout.word_off);
  job.counters = counters;
  job.q_tiles = layout.q_tiles, job.k_tiles = layout.k_tiles, job.max_q_span = max_q_span;
  job.q_rows = q_rows, job.k_rows = k_rows;
  const int64_t q_ctas = (instances * layout.q_tiles + kSegmentWarps - 1) / kSegmentWarps;
  const int64_t k_ctas = (instances * layout.k_tiles + kSegmentWarps - 1) / kSegmentWarps;
  const int64_t ctas = q_ctas + k_ctas + (key_spans ? q_ctas : 0);
  if (ctas > INT_MAX) return cudaErrorInvalidConfiguration;
  job.q_ctas = static_cast<unsigned>(q_ctas), job.k_ctas = static_cast<unsigned>(k_ctas);
  tiles.q = job.q, tiles.k = job.k, tiles.key_spans = job.spans, tiles.span_exceeded = job.span_exceeded;
  tiles.q_tiles = layout.q_tiles, tiles.k_tiles = layout.k_tiles;
  segment_tables<kSegmentWarps><<<static_cast<unsigned>(ctas), 32 * kSegmentWarps, 0, stream>>>(p, job);
  return cudaGetLastError();
}

}  // namespace jaxflash::gpu
