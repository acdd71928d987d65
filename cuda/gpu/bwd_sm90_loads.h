// The sm_90 backward's Q-tile loads (bwd_sm90_kernel.h): the two-stage ring of
// Q, dO, their rows' lse2 / delta and row words, and the producer warp that
// fills it by TMA, so that the consumer warpgroups hold no load addressing
// state and never wait on a load they issued themselves.
//
// Per Q tile the CTA visits, in the consumers' order (the running count n over
// the CTA's whole walk, every instance of its GQA group, names the stage n % 2
// and its phase):
//   producer   waits empty[s] (tile n - 2's readers are done), then lane 0
//              announces the stage's bytes on full[s] and issues two TMA tile
//              loads (Q, dO: the descriptors of tma_encode.h; rows past T
//              arrive as zeros) and two 1-D bulk copies (lse2, delta: the
//              workspace pads them to whole tiles); with dropout or the score
//              modifiers every lane also writes its share of the row words
//              (the rows' dropout keys, or their segment ids) and arrives.
//   consumers  wait full[s] (every thread), compute, and arrive on empty[s]
//              (every thread) once the tile's last products, which read Q
//              and dO, have completed. Every reader arrives, not a lane per
//              warp: a thread's own arrival is what orders its shared-memory
//              reads (lse2, delta, row words) before the producer's next
//              writes; a lane's arrival says nothing of its warp's other
//              lanes (compute-sanitizer's racecheck flags exactly that).
//
// No deadlock. The producer and the consumers step the same tiles (visited_q_tile
// over the same instances and visible range, with the same segment-id skipping),
// so each full phase the consumers wait for is one the producer completes, and
// each empty phase the producer waits for (tile n - 2's release, n >= 2; the first
// pass over a fresh barrier returns at once, tma.h) is one the consumers give:
// they release tile n - 2 after computing it, which needs only its own load, their
// own named barriers and the writer's release of a dQ stage (bwd_dq.h's argument).
// The producer waits for nothing else. A CTA whose keys see no query tile loads and
// waits for nothing; after the last tile the producer leaves with no copy in
// flight that the consumers do not wait for, and the releases of the last two
// tiles have no waiter, which an mbarrier allows.
#pragma once

#include <cstdint>

#include "bwd_kernel_traits.h"
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

// The ring in shared memory (the offsets of BwdSm90Config, from its
// 1024-byte aligned base): stage s holds Q and dO, lse2 and delta, a word per
// row, and its mbarriers.
template <class Cfg>
struct QTileStages {
  static constexpr int BM = Cfg::kBlockM;
  using QTile = typename Cfg::QTile;
  // Rows that carry a word (the dropout's keys, or segment ids): every producer
  // lane writes its share and arrives on full, after its stores.
  static constexpr bool kRowWords = Cfg::kDropout || Cfg::kSegmentIds;
  static constexpr int kFullArrivals = kRowWords ? 32 : 1;
  static constexpr int kEmptyArrivals = Cfg::kConsumerThreads;  // every reader (see the top)
  static constexpr uint32_t kTxBytes = 2 * QTile::kBytes + 2 * BM * 4;  // what the bulk engine writes

  char* base;
  __device__ __forceinline__ QTile q(int s) const { return QTile{base + 2 * s * QTile::kBytes}; }
  __device__ __forceinline__ QTile d_o(int s) const { return QTile{base + (2 * s + 1) * QTile::kBytes}; }
  __device__ __forceinline__ float* lse2(int s) const {
    return reinterpret_cast<float*>(base + Cfg::kStatsOff) + 2 * s * BM;
  }
  __device__ __forceinline__ float* delta(int s) const { return lse2(s) + BM; }
  __device__ __forceinline__ uint32_t* row_words(int s) const {
    return reinterpret_cast<uint32_t*>(base + Cfg::kRowWordsOff) + s * BM;
  }
  __device__ __forceinline__ uint64_t* full(int s) const {
    return reinterpret_cast<uint64_t*>(base + Cfg::kLoadBarsOff) + s;
  }
  __device__ __forceinline__ uint64_t* empty(int s) const { return full(2 + s); }

  // By one thread, before a CTA barrier.
  __device__ __forceinline__ void init_barriers() const {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full(s), kFullArrivals);
      mbar_init(empty(s), kEmptyArrivals);
    }
  }
};

// The producer: the whole warp (lane = its lane) walks the Q tiles the consumers
// visit for key tile `key_tile` of kept instance `kept` and loads each into the
// ring, lane 0 issuing the copies. The score-mods copy's ballots (visited_q_tile)
// need the whole warp.
template <class Cfg>
__device__ __forceinline__ void load_q_tiles(const AttentionParams& p, const BwdRuntime& rt,
                                             const QTileStages<Cfg>& stages, int64_t kept, int64_t key_tile,
                                             int lane) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  constexpr bool kIds = Cfg::kSegmentIds;
  const int64_t n0 = key_tile * BN;
  uint32_t n = 0;  // tiles loaded: the stage and its phase
#pragma unroll 1
  for (int64_t r = 0; r < rt.kv_reduced; ++r) {
    const int64_t linear = compose_instance(p, rt.kv_reduce_mask, kept, r);
    const KeyRange rows = visible_queries(p, instance_bounds(p, linear), n0, n0 + BN);
    if (rows.lo >= rows.hi) continue;
    const int64_t i_last = (rows.hi - 1) / BM;
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
    for (int64_t i = visited_q_tile<kIds>(rt, linear, rows.lo / BM, i_last, key_tile, lane); i <= i_last;
         i = visited_q_tile<kIds>(rt, linear, i + 1, i_last, key_tile, lane), ++n) {
      const Stage<2> st(n);
      const int m0 = static_cast<int>(i * BM);  // below 2^31 (tma_encode.h)
      uint64_t* const full = stages.full(st.index);
      mbar_wait(stages.empty(st.index), st.parity ^ 1u);
      if constexpr (QTileStages<Cfg>::kRowWords) {
        uint32_t* const words = stages.row_words(st.index);
#pragma unroll
        for (int row = lane; row < BM; row += 32) {
          if constexpr (Cfg::kDropout) words[row] = dropout.row_key(m0 + row);
          else if (ids)
            words[row] = m0 + row < p.seqlen_q ? __ldg(q_ids + (m0 + row) * p.q_segment_ids.row_stride) : 0;
        }
      }
      if (lane == 0) {
        mbar_arrive_expect_tx(full, QTileStages<Cfg>::kTxBytes);
        tma_load_tile(rt.tma_q, q_inst, full, stages.q(st.index), m0);
        tma_load_tile(rt.tma_do, do_inst, full, stages.d_o(st.index), m0);
        bulk_load(stages.lse2(st.index), lse2_rows + m0, BM * 4, full);
        bulk_load(stages.delta(st.index), delta_rows + m0, BM * 4, full);
      } else if constexpr (QTileStages<Cfg>::kRowWords) {
        mbar_arrive_if(full, true);
      }
    }
  }
}

}  // namespace jaxflash::gpu
