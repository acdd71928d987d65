// A backward CTA's own key tile, shared by the main kernels (bwd_kernel.h,
// bwd_sm90_kernel.h): its K and V stay in shared memory across the instances
// that read the same rows (the query heads of a GQA group), and its dK and dV,
// accumulated in registers over all of them, leave through shared memory once.
#pragma once

#include <cstdint>

#include "bwd_kernel_traits.h"
#include "instance.h"
#include "primitives/smem_tile.h"
#include "primitives/tma.h"
#include "primitives/warp_gemm.h"
#include "../params.h"

namespace jaxflash::gpu {

// This CTA's kept instance and key tile. CTAs do not use blockIdx: each takes a
// ticket from the zeroed counter on entry. Tickets run through groups of
// rt.ticket_group instances, and inside a group key tile slowest: within an
// instance key tiles follow the ticket in the order their dQ turns take
// (key_tile_turn), which is what keeps the dQ protocol free of deadlock (bwd_dq.h,
// "No deadlock"). The groups keep a few instances' Q / dO in L2 for the CTAs in
// flight (bwd_tile_size.h: kBwdKeyTilesInFlight).
//
// The order: ascending key tiles, or descending (keys_descend) where the
// keys visible to a query end at a window's right edge (causal masking). There,
// key tile j visits Q tiles j, j + 1, ... (from its diagonal down), and Q tile
// i is added to by key tiles ... i - 1, i. In ascending order key tile j's
// first add (Q tile j) waits for every earlier key tile to reach Q tile j, the
// next ones likewise, so key tile j finishes about j Q tiles late and holds its
// SM idle meanwhile (the short tiles near the end wait longest: at N = 1k, 8
// key tiles, 36 tile pairs of work took about 92 of SM time in that model). In
// descending order Q tile i is added to first by key tile i, whose first Q tile
// it is, then by i - 1, for which it is the second, and so on: each add finds
// its turn already come. The cost: the group's longest CTAs, the first key
// tiles, take the last tickets, and an instance's key tiles in flight sit at Q
// tiles far apart, so their Q / dO reads hit L2 only while the group's whole Q
// and dO stay there: launch_backward descends only where they fit (measured:
// 1.18-1.25x at N = 1k, 0.62-0.95x at 4k-16k where they did not).
// Whether this launch's key tiles descend: the host's choice (launch_backward), unless under
// segment ids the id tables' kernel found a key tile whose documents span more query tiles than
// L2 keeps for the group (segment_tile_ranges.h). One word, the same for every CTA of the
// launch, so that tickets and dQ turns follow one order.
__device__ __forceinline__ bool keys_descend(const BwdRuntime& rt) {
  return rt.keys_descend && (rt.segments.span_exceeded == nullptr || __ldg(rt.segments.span_exceeded) == 0);
}

struct KeyTileTicket {
  int64_t kept;      // the kept instance
  int64_t key_tile;  // keys [key_tile * BLOCK_N, + BLOCK_N)
};

// Ticket `ticket` (below rt.tickets) as (kept instance, key tile), in the width of Index:
// `int` where the tickets fit (the launchers check they do), whose divisions take a few
// registers where the sm_90 producer has 24 (in 64 bits it spilled ~500 bytes).
template <class Index>
__device__ __forceinline__ KeyTileTicket decode_key_tile(const BwdRuntime& rt, Index ticket) {
  const Index group_size = static_cast<Index>(rt.ticket_group), k_tiles = static_cast<Index>(rt.k_tiles);
  const Index per_group = group_size * k_tiles;
  const Index group = ticket / per_group, first = group * group_size, in_group = ticket - group * per_group;
  const Index size = min(group_size, static_cast<Index>(rt.kv_kept) - first);  // the last group may be smaller
  const Index nth = in_group / size;
  return {first + in_group % size, keys_descend(rt) ? k_tiles - 1 - nth : nth};
}

// The CTA's ticket, taken on entry (the mma.sync kernel: a CTA per ticket); its CTA barrier
// also covers what thread 0 initialised before.
__device__ __forceinline__ KeyTileTicket take_key_tile(const BwdRuntime& rt, int tid) {
  __shared__ int s_ticket;
  if (tid == 0) s_ticket = atomicAdd(rt.counter, 1);
  __syncthreads();
  return decode_key_tile<int>(rt, s_ticket);
}

// The key tiles [lo, hi) that add to Q tile i before key tile `key_tile` (without segment ids,
// all of them): the range key_tile_turn counts.
template <int BM, int BN>
__device__ __forceinline__ KeyRange key_tiles_before(const AttentionParams& p, const BwdRuntime& rt,
                                                     const InstanceBounds& b, int64_t i, int64_t key_tile) {
  const KeyRange keys = visible_keys(p, b, i * BM, i * BM + BM);
  return keys_descend(rt) ? KeyRange{key_tile + 1, (keys.hi + BN - 1) / BN} : KeyRange{keys.lo / BN, key_tile};
}

// Key tile `key_tile`'s dQ turn on Q tile i (rows [i BM, i BM + BM)) of instance
// `linear` (bwd_dq.h): how many key tiles add to that Q tile before it. Those
// that add are the range the band lets meet the Q tile, under segment ids
// (`ids`) only those whose id ranges meet its (SegmentTiles, a ballot: every lane
// of the warp calls), in the order of the tickets (take_key_tile).
template <int BM, int BN>
__device__ __forceinline__ int key_tile_turn(const AttentionParams& p, const BwdRuntime& rt,
                                             const InstanceBounds& b, int64_t linear, int64_t i,
                                             int64_t key_tile, bool ids, int lane) {
  const KeyRange before = key_tiles_before<BM, BN>(p, rt, b, i, key_tile);
  return ids ? rt.segments.meeting_key_tiles(linear, i, before.lo, before.hi, lane)
             : static_cast<int>(before.hi - before.lo);
}

// The K / V rows now in shared memory.
template <class T>
struct ResidentKv {
  const T* k = nullptr;
  const T* v = nullptr;
  int rows = -1;

  // Copies the tile's K and V (rows past `rows` zero-filled: padding may hold
  // anything, NaN included) unless they are the resident ones: same origins and
  // row count, same contents. cp.async; the caller commits and waits.
  template <int kThreads, class Tile>
  __device__ __forceinline__ void load(const Tile& sK, const Tile& sV, const AttentionParams& p, const T* k_tile,
                                       const T* v_tile, int tile_rows, bool k_vec, bool v_vec, int tid) {
    if (k_tile == k && v_tile == v && tile_rows == rows) return;
    const int head_dim = static_cast<int>(p.head_dim);
    load_tile<kThreads>(sK, k_tile, p.k.row_stride, tile_rows, head_dim, k_vec, tid);
    load_tile<kThreads>(sV, v_tile, p.v.row_stride, tile_rows, head_dim, v_vec, tid);
    k = k_tile, v = v_tile, rows = tile_rows;
  }
};

// The epilogue: dK (x scale) and dV (x dv_scale) from the lanes' fragments,
// whose block starts at (frag_row0, frag_col0) of the tile, to shared memory
// as T (over K and V, no longer read), then whole rows to global memory. Keys
// in [kv_len, S) are written too: their accumulators are 0. Between the steps
// the kThreads threads, the whole CTA, meet at its barrier. (The sm_90 kernel
// stores from registers instead: bwd_sm90_kernel.h's store_key_rows.)
template <int kThreads, int BN, class T, class Tile, int MF, int NF>
__device__ __forceinline__ void store_dk_dv(const AttentionParams& p, const BwdRuntime& rt, const Tile& sK,
                                            const Tile& sV, const float (&dk)[MF][NF][4],
                                            const float (&dv)[MF][NF][4], int frag_row0, int frag_col0,
                                            int64_t kept, int64_t n0, int tid) {
  const int lane = tid % 32;
  cp_async_wait<0>();
  named_sync(0, kThreads);
  store_frags<T>(sK, dk, frag_row0, frag_col0, rt.scale, lane);
  store_frags<T>(sV, dv, frag_row0, frag_col0, rt.dv_scale, lane);
  named_sync(0, kThreads);
  const InstanceIndex out(p, compose_instance(p, rt.kv_reduce_mask, kept, 0));  // dk/dv: stride 0 on the group
  const int rows_out = static_cast<int>(min(p.seqlen_k - n0, int64_t{BN}));
  const int head_dim = static_cast<int>(p.head_dim);
  store_tile_rows<kThreads, BN>(sK, 0, out.origin<T>(p, p.dk) + n0 * p.dk.row_stride, p.dk.row_stride, rows_out,
                                head_dim, rt.dk_vec, tid);
  store_tile_rows<kThreads, BN>(sV, 0, out.origin<T>(p, p.dv) + n0 * p.dv.row_stride, p.dv.row_stride, rows_out,
                                head_dim, rt.dv_vec, tid);
}

// The CTA's dscale (kHasDscale, params.h): the threads' shares summed in a fixed order
// (deterministic, no atomics) into the key tile's first row of its kept instance, 0 into the
// tile's other rows, so that every element has one writer. Every thread of the CTA calls it.
template <int kThreads, int BN>
__device__ __forceinline__ void store_dscale(const AttentionParams& p, const BwdRuntime& rt, float share,
                                             int64_t kept, int64_t n0, int tid) {
  static_assert(BN <= kThreads, "a thread per row of the tile");
  constexpr int kWarps = kThreads / 32;
  __shared__ float warp_sums[kWarps];
#pragma unroll
  for (int m = 16; m >= 1; m /= 2) share += __shfl_xor_sync(0xffffffffu, share, m);
  if (tid % 32 == 0) warp_sums[tid / 32] = share;
  __syncthreads();
  const int rows_out = static_cast<int>(min(p.seqlen_k - n0, int64_t{BN}));
  if (tid >= rows_out) return;
  float sum = 0.f;
  if (tid == 0)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += warp_sums[w];
  const InstanceIndex out(p, compose_instance(p, rt.kv_reduce_mask, kept, 0));  // stride 0 on the group, as dk
  out.origin<float>(p, p.dscale)[(n0 + tid) * p.dscale.row_stride] = sum;
}

}  // namespace jaxflash::gpu
