// The sm_90 backward's loads (bwd_sm90_kernel.h): a producer warp fills, by
// TMA, the two-stage ring of Q, dO, their rows' lse2 / delta and row words, and
// K / V once per key tile, and hands the CTA its work items, so that the
// consumer warpgroups hold no load addressing state and never wait on a load
// they issued themselves.
//
// Items. The kernel is persistent: a grid of at most one CTA per SM, each CTA
// taking tickets (bwd_key_tile.h: a kept instance and a key tile) from the
// workspace's counter until they run out. The producer's lane 0 takes each
// ticket and passes it through two slots (full: its arrival; empty: every
// consumer thread's and the writer's, each after its own read of the slot) to
// the consumers and the dQ writer; a ticket past the last is the end.
//
// K / V. Per item, before the first Q tile of its first visited instance (and
// of every visited instance where rt.kv_per_instance says an item's instances
// may differ in their K / V or key length: backward.cu), the producer waits for
// kv_empty (the consumers are done with the previous K / V: every consumer
// thread arrives once its last product that reads them has completed, at the
// end of an item or before such a reload) and loads both tiles on kv_full. Rows
// past the tensor arrive as zeros; rows in [kv_len, S), which a sequence length
// hides but the tensor holds (anything, NaN included), the consumers zero before
// their first product, as cp.async's zero fill did: dQ = dS K would turn a 0 of
// dS times a NaN of K into NaN.
//
// Per Q tile the CTA visits, in the consumers' order (the running count n over
// the CTA's whole life names the stage n % 2 and its phase):
//   producer   waits empty[s] (tile n - 2's readers are done), then lane 0
//              announces the stage's bytes on full[s] and issues two TMA tile
//              loads (Q, dO: the descriptors of tma_encode.h; rows past T
//              arrive as zeros) and two 1-D bulk copies (lse2, delta: the
//              workspace pads them to whole tiles); with dropout or segment
//              ids every lane then writes its share of the row words (the
//              rows' dropout keys, or their segment ids), lane 0 with ids the
//              tile's plan (QTilePlan), and every lane arrives.
//   consumers  wait full[s] (every thread), compute, and arrive on empty[s]
//              (every thread) once the tile's last products, which read Q
//              and dO, have completed. Every reader arrives, not a lane per
//              warp: a thread's own arrival is what orders its shared-memory
//              reads (lse2, delta, row words, plan) before the producer's next
//              writes; a lane's arrival says nothing of its warp's other
//              lanes (compute-sanitizer's racecheck flags exactly that).
//
// No deadlock. The producer and the consumers step the same items, instances
// and tiles (group_instance's first tile, then the next one, which with
// segment ids the consumers take from the producer's plan; the same K / V
// loads), so each full
// phase the consumers wait for is one the producer completes, and each empty
// phase the producer waits for is one the consumers give: they release a Q
// tile's stage after computing it, K / V after their item's last tile (or
// before a reload), and a slot on reading it, which needs only loads already
// issued, their own named barriers and the writer's release of a dQ stage
// (bwd_dq.h's argument; a writer waits on other CTAs only for smaller
// tickets, and a CTA takes its next ticket only after issuing its current
// item's loads). The first pass over a fresh barrier returns at once (tma.h).
// After the end mark the producer leaves with no copy in flight that the
// consumers do not wait for; releases without a waiter are allowed.
#pragma once

#include <cstdint>

#include "bwd_key_tile.h"
#include "bwd_kernel_traits.h"
#include "instance.h"
#include "primitives/smem_tile.h"
#include "primitives/tma.h"
#include "../dropout.h"
#include "../params.h"

namespace jaxflash::gpu {

// The first Q tile from i on (to i_last) that key tile `key_tile` of instance
// `linear` visits: i, or with kIds (the kSegmentIds copy) the first whose ids may
// meet the key tile's (a ballot: the whole warp calls, converged); > i_last
// when none. The consumers and the producer step their tiles with it.
template <bool kIds>
__device__ __forceinline__ int64_t visited_q_tile(const BwdRuntime& rt, int64_t linear, int64_t i, int64_t i_last,
                                                  int64_t key_tile, int lane) {
  return kIds ? rt.segments.next_meeting_q_tile(linear, i, i_last, key_tile, lane) : i;
}

// Instance r of an item's GQA group (kept instance `kept`, keys from n0) as the three roles
// walk it: its index, bounds, and the Q tiles [first, last] its keys see (first > last: none;
// with kIds the first whose ids may meet the key tile's, a ballot of the whole warp).
struct GroupInstance {
  int64_t linear;
  InstanceBounds b;
  int64_t first, last;
};
template <int BM, int BN, bool kIds>
__device__ __forceinline__ GroupInstance group_instance(const AttentionParams& p, const BwdRuntime& rt, int64_t kept,
                                                        int64_t r, int64_t key_tile, int lane) {
  GroupInstance g;
  g.linear = compose_instance(p, rt.kv_reduce_mask, kept, r);
  g.b = instance_bounds(p, g.linear);
  const KeyRange rows = visible_queries(p, g.b, key_tile * BN, key_tile * BN + BN);
  g.last = rows.lo < rows.hi ? (rows.hi - 1) / BM : -1;
  g.first = rows.lo < rows.hi ? visited_q_tile<kIds>(rt, g.linear, rows.lo / BM, g.last, key_tile, lane) : 0;
  return g;
}

// The segment-id copy's plan of a staged Q tile, formed by the producer (which walks the
// same tiles anyway; SegmentTiles::backward_step, one round of loads) and read by the consumers
// with the tile, so that their Q-tile loop holds no table load or ballot: the next Q tile they
// visit (> i_last: none), the key tile's dQ turn on this one (key_tile_turn's count), and
// whether the pair needs the per-element id test (only then does the producer load the
// queries' ids). Formed as three scans in a row, it made the producer's chain per tile the
// kernel's bound (docs/DESIGN.md: packed documents' fwd+bwd 0.75 -> 0.85 of separate rows).
struct QTilePlan {
  int32_t next;  // Q tile indices are below 2^31 / BLOCK_M (tma_encode.h's coordinates)
  int32_t turn;
  uint32_t id_test;
};

// The loads' shared memory (the offsets of BwdSm90Config, from its 1024-byte
// aligned base): stage s holds Q and dO, lse2 and delta, a word per row; then
// K and V, and at kLoadBarsOff the mbarriers (the stages' full 0, 1 and empty
// 0, 1, K / V's full and empty, the item slots' full 0, 1 and empty 0, 1), the
// two item slots, and the stages' two plans (QTilePlan, 16 bytes each).
template <class Cfg>
struct QTileStages {
  static constexpr int BM = Cfg::kBlockM;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  // Rows that carry a word (the dropout's keys, or segment ids): every producer
  // lane writes its share and arrives on full, after its stores.
  static constexpr bool kRowWords = Cfg::kDropout || Cfg::kSegmentIds;
  static constexpr int kFullArrivals = kRowWords ? 32 : 1;
  static constexpr int kEmptyArrivals = Cfg::kConsumerThreads;  // every reader (see the top)
  static constexpr uint32_t kTxBytes = 2 * QTile::kBytes + 2 * BM * 4;  // what the bulk engine writes
  static constexpr uint32_t kKvTxBytes = 2 * KTile::kBytes;

  char* base;
  __device__ __forceinline__ QTile q(int s) const { return QTile{base + 2 * s * QTile::kBytes}; }
  __device__ __forceinline__ QTile d_o(int s) const { return QTile{base + (2 * s + 1) * QTile::kBytes}; }
  __device__ __forceinline__ KTile k() const { return KTile{base + Cfg::kKOff}; }
  __device__ __forceinline__ KTile v() const { return KTile{base + Cfg::kVOff}; }
  __device__ __forceinline__ float* lse2(int s) const {
    return reinterpret_cast<float*>(base + Cfg::kStatsOff) + 2 * s * BM;
  }
  __device__ __forceinline__ float* delta(int s) const { return lse2(s) + BM; }
  __device__ __forceinline__ uint32_t* row_words(int s) const {
    return reinterpret_cast<uint32_t*>(base + Cfg::kRowWordsOff) + s * BM;
  }
  __device__ __forceinline__ uint64_t* bar(int i) const {
    return reinterpret_cast<uint64_t*>(base + Cfg::kLoadBarsOff) + i;
  }
  __device__ __forceinline__ uint64_t* full(int s) const { return bar(s); }
  __device__ __forceinline__ uint64_t* empty(int s) const { return bar(2 + s); }
  __device__ __forceinline__ uint64_t* kv_full() const { return bar(4); }
  __device__ __forceinline__ uint64_t* kv_empty() const { return bar(5); }
  __device__ __forceinline__ uint64_t* item_full(int s) const { return bar(6 + s); }
  __device__ __forceinline__ uint64_t* item_empty(int s) const { return bar(8 + s); }
  __device__ __forceinline__ KeyTileTicket* item_slot(int s) const {
    return reinterpret_cast<KeyTileTicket*>(bar(10)) + s;
  }
  __device__ __forceinline__ QTilePlan* plan(int s) const {
    static_assert(sizeof(KeyTileTicket) == 16 && sizeof(QTilePlan) <= 16, "the slots' layout (BwdSm90Config)");
    return reinterpret_cast<QTilePlan*>(reinterpret_cast<char*>(item_slot(2)) + 16 * s);
  }

  // By one thread, before a CTA barrier.
  __device__ __forceinline__ void init_barriers() const {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full(s), kFullArrivals);
      mbar_init(empty(s), kEmptyArrivals);
      mbar_init(item_full(s), 1);
      // and the writers, except in the segment-id copy, whose writers take named turns only
      mbar_init(item_empty(s), Cfg::kConsumerThreads + (Cfg::kSegmentIds ? 0 : Cfg::kDqWriters));
    }
    mbar_init(kv_full(), 1);
    mbar_init(kv_empty(), Cfg::kConsumerThreads);
  }

  // The CTA's item n (counted over its life): a ticket's (kept instance, key tile), or
  // kept = -1 at the end. Sent by the producer warp (`leader` writes), received by every
  // consumer thread and the writers (not the segment-id copy's).
  __device__ __forceinline__ void send_item(uint32_t n, const KeyTileTicket& item, bool leader) const {
    const Stage<2> slot(n);
    mbar_wait(item_empty(slot.index), slot.parity ^ 1u);
    if (leader) {
      *item_slot(slot.index) = item;
      mbar_arrive(item_full(slot.index));  // a release: the item is visible to whoever sees the phase
    }
  }
  __device__ __forceinline__ KeyTileTicket receive_item(uint32_t n) const {
    const Stage<2> slot(n);
    mbar_wait(item_full(slot.index), slot.parity);
    const KeyTileTicket item = *item_slot(slot.index);
    mbar_arrive(item_empty(slot.index));
    return item;
  }
};

// The producer's loads for one item (key tile `key_tile` of kept instance
// `kept`): the whole warp (lane = its lane) walks the Q tiles the consumers
// visit and loads each into the ring, with the item's K / V before its first
// visited instance's tiles (and each one's with rt.kv_per_instance), lane 0 issuing the
// copies. The segment-id copy's ballots (visited_q_tile, backward_step) need the whole warp.
// n: the Q tiles loaded over the CTA's life; kv_loads: its K / V loads.
template <class Cfg>
__device__ __forceinline__ void load_item(const AttentionParams& p, const BwdRuntime& rt,
                                          const QTileStages<Cfg>& stages, int64_t kept, int64_t key_tile, int lane,
                                          uint32_t& n, uint32_t& kv_loads) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  constexpr bool kIds = Cfg::kSegmentIds;
  const int64_t n0 = key_tile * BN;
  bool kv_loaded = false;  // this item's K / V
#pragma unroll 1
  for (int64_t r = 0; r < rt.kv_reduced; ++r) {
    const GroupInstance g = group_instance<BM, BN, kIds>(p, rt, kept, r, key_tile, lane);
    const int64_t linear = g.linear, i_last = g.last;
    int64_t i = g.first;
    if (i > i_last) continue;  // (as the consumers: no tile, no K / V)
    if (!kv_loaded || rt.kv_per_instance) {
      kv_loaded = true;
      mbar_wait(stages.kv_empty(), (kv_loads & 1u) ^ 1u);
      ++kv_loads;
      if (lane == 0) {
        int k_inst[3], v_inst[3];
        rt.tma_k.instance_coords(linear, k_inst);
        rt.tma_v.instance_coords(linear, v_inst);
        mbar_arrive_expect_tx(stages.kv_full(), QTileStages<Cfg>::kKvTxBytes);
        tma_load_tile(rt.tma_k, k_inst, stages.kv_full(), stages.k(), static_cast<int>(n0));
        tma_load_tile(rt.tma_v, v_inst, stages.kv_full(), stages.v(), static_cast<int>(n0));
      }
    }
    int q_inst[3], do_inst[3];
    rt.tma_q.instance_coords(linear, q_inst);
    rt.tma_do.instance_coords(linear, do_inst);
    const float* const lse2_rows = rt.lse2 + linear * rt.t_pad;
    const float* const delta_rows = rt.delta + linear * rt.t_pad;
    // The row words: with dropout the rows' keys, hashed once per tile here rather than by
    // each consumer lane for the 16 queries of each of its sub-tiles; with segment ids the
    // queries' ids (0 past T, where nothing reads them).
    const DropoutKey dropout =
        Cfg::kDropout ? make_dropout_key(p, static_cast<const uint32_t*>(p.seed.data) + instance_offset(p, p.seed, linear))
                      : DropoutKey{};
    const bool ids = kIds && rt.segments.q != nullptr;
    const int32_t* const q_ids =
        ids ? static_cast<const int32_t*>(p.q_segment_ids.data) + instance_offset(p, p.q_segment_ids, linear)
            : nullptr;
#pragma unroll 1
    for (int64_t i_next; i <= i_last; i = i_next, ++n) {
      const Stage<2> st(n);
      const int m0 = static_cast<int>(i * BM);  // below 2^31 (tma_encode.h)
      uint64_t* const full = stages.full(st.index);
      // The next tile, and with kIds the tile's plan for the consumers (one step of ballots,
      // while the stage may still be in use).
      QTilePlan plan{};
      if constexpr (kIds) {
        const KeyRange before = key_tiles_before<BM, BN>(p, rt, g.b, i, key_tile);
        const QTileStep step = rt.segments.backward_step(linear, i, i_last, key_tile, before.lo, before.hi, lane);
        i_next = step.next;
        plan = QTilePlan{static_cast<int32_t>(i_next), step.turn, step.id_test};
      } else {
        i_next = i + 1;
      }
      mbar_wait(stages.empty(st.index), st.parity ^ 1u);
      if (lane == 0) {
        // The copies first, so that they start one global load earlier than the row words'.
        if constexpr (QTileStages<Cfg>::kRowWords) mbar_expect_tx(full, QTileStages<Cfg>::kTxBytes);
        else mbar_arrive_expect_tx(full, QTileStages<Cfg>::kTxBytes);
        tma_load_tile(rt.tma_q, q_inst, full, stages.q(st.index), m0);
        tma_load_tile(rt.tma_do, do_inst, full, stages.d_o(st.index), m0);
        bulk_load(stages.lse2(st.index), lse2_rows + m0, BM * 4, full);
        bulk_load(stages.delta(st.index), delta_rows + m0, BM * 4, full);
        if constexpr (kIds) *stages.plan(st.index) = plan;
      }
      if constexpr (QTileStages<Cfg>::kRowWords) {
        uint32_t* const words = stages.row_words(st.index);
#pragma unroll
        for (int row = lane; row < BM; row += 32) {
          if constexpr (Cfg::kDropout) words[row] = dropout_mix_first(dropout.row_key(m0 + row));  // (the hash's first step)
          else if (plan.id_test)  // (the queries' ids: read by the consumers' test alone)
            words[row] = m0 + row < p.seqlen_q ? __ldg(q_ids + (m0 + row) * p.q_segment_ids.row_stride) : 0;
        }
        mbar_arrive(full);  // every lane, after its stores (lane 0's plan too)
      }
    }
  }
}

// The producer warp over the CTA's life: takes each ticket (lane 0, from the workspace's
// counter), hands it to the consumers and the writers, and loads its item; the end mark when
// the tickets run out.
template <class Cfg>
__device__ __forceinline__ void produce(const AttentionParams& p, const BwdRuntime& rt,
                                       const QTileStages<Cfg>& stages, int lane) {
  uint32_t n = 0, kv_loads = 0;
#pragma unroll 1
  for (uint32_t item = 0;; ++item) {
    const int ticket = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(rt.counter, 1) : 0, 0);
    const KeyTileTicket t = ticket < rt.tickets ? decode_key_tile<int>(rt, ticket) : KeyTileTicket{-1, 0};
    stages.send_item(item, t, lane == 0);
    if (t.kept < 0) return;
    load_item<Cfg>(p, rt, stages, t.kept, t.key_tile, lane, n, kv_loads);
  }
}

}  // namespace jaxflash::gpu
