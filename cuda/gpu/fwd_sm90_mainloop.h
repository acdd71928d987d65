// The sm_90 forward's two roles over one query tile's key tiles: the producer
// thread's TMA loads and a consumer warpgroup's products and softmax.
//
// Pipeline: Q once per query tile, with a "full" transaction mbarrier (the TMA
// counts its bytes) and an "empty" one that each consumer warp arrives on when
// nothing reads the buffer any more; K and V through kStages buffers each, with
// the same pair of mbarriers per buffer. A CTA computes query tile after query
// tile (fwd_sm90_kernel.h), so every barrier's phase follows a count that runs
// over the CTA's whole life: the query tiles for Q's, the key tiles loaded so
// far for the stages'. Key tiles go from the last to the first, as in the
// mma.sync kernel (fwd_mainloop.h), so the one tile with rows past kv_len comes
// first. The producer loads K of tile i + 1 before V of tile i, the order the
// consumers use them in.
//
// A consumer warpgroup owns 64 query rows and runs rounds r = 0 .. n (n key
// tiles); round r issues
//   S_r = Q K_r^T             (SS wgmma, 64 x BLOCK_N, if r < n)
//   O  += P_{r-1} V_{r-1}     (RS wgmma, P from registers, if r > 0)
// together, then computes the softmax of S_r while the second product runs,
// and only then rescales O (the product had to finish first) and turns S_r
// into the next round's P. So the tensor cores always have the next product
// queued while the softmax runs (FlashAttention-3's intra-warpgroup overlap; the
// wait for P V needs wgmma_wait_in_order to stay below the exp2s, and the copies of
// three consumers run without it: tile_size.h's kSoftmaxBesidePv).
// With kPingPong the two warpgroups also take turns to issue their products,
// so one's softmax runs while the other's products do.
//
// The producer and every consumer walk the same key tiles (KeyTileWalk): all
// of the visible range, or with segment ids (the copies that take them) only the
// tiles whose id range may meet the query tile's, so that packed documents
// cost what separate rows do.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fwd_scores.h"
#include "kernel_traits.h"
#include "primitives/dropout.h"
#include "primitives/positions.h"
#include "primitives/score.h"
#include "primitives/smem_tile.h"
#include "primitives/softmax.h"
#include "primitives/tma.h"
#include "primitives/wgmma.h"
#include "segment_tiles.h"
#include "timeline.h"
#include "../params.h"

namespace jaxflash::gpu {

// The key tiles one CTA visits, from the top down (as the mma.sync kernel goes,
// fwd_mainloop.h): every tile of the visible key range [keys.lo, keys.hi), or
// with segment ids only those whose id range may meet the query tile's
// (segment_tiles.h; the tables hold this kernel's tiles, forward.cu). A tile
// is named by its first key n0; visits(n0) is false past the last one. With
// segment ids a whole warp, converged, steps (start, next): it reads a window of
// 32 tiles at once, one per lane, into two ballots (which tiles may meet the
// query tile, which need the per-element test) and steps through them in
// registers, so that a round reads no table (reading the tables each round put
// two dependent loads in every round's critical path) and a document's last
// tile is not followed by a serial scan of every earlier document's tiles
// (causal packing: the visible range reaches back to the row's first key; the
// key spans, which bound the walk to the tiles between the first and the last
// that meet the query tile, remove the scan altogether for sorted ids).
// A walk's state after its first step (KeyTileWalk::start), as the producer hands it to the
// consumers with the tile (FwdTileSlot): its first tile `top` and what the walk holds then.
struct KeyWalkStart {
  int top, first, window_top;
  unsigned meets, tests;
};

template <class Cfg>
struct KeyTileWalk {
  static constexpr int BN = Cfg::kBlockN;
  const SegmentTiles& segments;
  int linear;  // the instance (32 bits: fwd_schedule.h)
  int q_tile, first, last, lane;
  // With segment ids: the window's top tile (lane l read tile window_top - l BN) and its bits.
  int window_top;
  unsigned meets = 0, tests = 0;

  __device__ __forceinline__ KeyTileWalk(const SegmentTiles& segments, int linear, int m0, const KeyRange& keys,
                                         int lane)
      : segments(segments),
        linear(linear),
        q_tile(m0 / Cfg::kBlockM),
        first(static_cast<int>(keys.lo) / BN * BN),
        // (empty key ranges: last < first, nothing visited)
        last(keys.lo < keys.hi ? static_cast<int>(keys.hi - 1) / BN * BN : first - BN),
        lane(lane) {
    // With segment ids, only the key tiles between the first and the last that meet the query
    // tile's ids (segment_tiles.h's key spans; none: last < first).
    if (Cfg::kSegmentIds && segments.key_spans != nullptr) {
      const TileSpan span = segments.key_spans[linear * segments.q_tiles + q_tile];
      first = max(first, span.lo * BN);
      last = min(last, span.hi * BN);
    }
    window_top = first - BN;  // (below every tile: the first step reads a window)
  }
  // The walk the producer started (start() returned s.top), which goes on from there without
  // reading the tables again until it leaves s's window.
  __device__ __forceinline__ KeyTileWalk(const SegmentTiles& segments, int linear, int m0, const KeyWalkStart& s,
                                         int lane)
      : segments(segments),
        linear(linear),
        q_tile(m0 / Cfg::kBlockM),
        first(s.first),
        last(s.top),
        lane(lane),
        window_top(s.window_top),
        meets(s.meets),
        tests(s.tests) {}
  // This walk after its start() returned top.
  __device__ __forceinline__ KeyWalkStart started(int top) const { return {top, first, window_top, meets, tests}; }

  __device__ __forceinline__ bool visits(int n0) const { return n0 >= first; }
  // The first tile, and the one after n0 (the walk's last step).
  __device__ __forceinline__ int start() { return Cfg::kSegmentIds ? meeting_from(last) : last; }
  __device__ __forceinline__ int next(int n0) { return Cfg::kSegmentIds ? meeting_from(n0 - BN) : n0 - BN; }
  // Whether tile n0, the walk's last step, needs the per-element id test (not one id on both
  // sides). (Its window is the one read for that step.)
  __device__ __forceinline__ bool needs_id_test(int n0) const {
    return Cfg::kSegmentIds && (tests >> ((window_top - n0) / BN) & 1u);
  }

 private:
  // The first tile from n0 down whose ids may meet the query tile's; < first when none.
  __device__ __forceinline__ int meeting_from(int n0) {
    for (; visits(n0); n0 = window_top - 32 * BN) {
      if (n0 > window_top || n0 <= window_top - 32 * BN) read_window(n0);
      const unsigned ahead = meets & (~0u << ((window_top - n0) / BN));
      if (ahead != 0) return window_top - (__ffs(ahead) - 1) * BN;
    }
    return first - BN;
  }
  __device__ __forceinline__ void read_window(int top) {
    window_top = top;
    const int mine = top - lane * BN;
    const bool in = visits(mine);
    meets = __ballot_sync(0xffffffffu, in && segments.may_meet(linear, q_tile, mine / BN));
    tests = __ballot_sync(0xffffffffu, in && segments.needs_test(linear, q_tile, mine / BN));
  }
};

// How a round applies the position mask: tested per tile, always (a tile that a causal
// diagonal, a window's edge or a sequence length crosses) or never (a tile every row sees
// whole). With Cfg::kSplitMaskLoops the main loop runs the always and never rounds as two
// loops of their own, so that the mask-free steady state compiles without the mask's
// registers (tile_size.h: at D = 64 one tested loop spilled the softmax state every round).
template <int kMode>
using MaskStep = std::integral_constant<int, kMode>;
constexpr int kMaskTest = 0, kMaskAlways = 1, kMaskNever = 2;

// Named barrier ids (0 is __syncthreads'): each consumer warpgroup's turn to
// issue (kPingPong: two consumers), and the consumers' meeting after zeroing
// V's padding rows.
constexpr int kTurnBarrier = 1;  // + warpgroup
constexpr int kZeroVBarrier = 3;

// What the producer hands the consumers per query tile (FwdSm90Smem's slots): its index (one
// >= rt.tiles for the end), and in the copies with segment ids the walk it started: the
// consumers' own start read the key span and a window of the tables, two dependent trips to
// L2 before their first product of every tile.
template <bool kSegmentIds>
struct FwdTileSlot {
  int index;
};
template <>
struct FwdTileSlot<true> {
  int index;
  KeyWalkStart walk;
};

// The CTA's shared memory: Q, O on its way out (its own buffer with
// Cfg::kSeparateO, else Q's), the K and V stages, the mbarriers and the tile
// slots through which the producer hands the consumers their next query tile,
// from a 1024-byte aligned base (the 128-byte swizzle's atom).
template <class Cfg>
struct FwdSm90Smem {
  static constexpr int S = Cfg::kStages, kSlots = Cfg::kTileSlots;
  using Slot = FwdTileSlot<Cfg::kSegmentIds>;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  static constexpr int kOOff = Cfg::kSeparateO ? QTile::kBytes : 0;
  static constexpr int kKOff = kOOff + QTile::kBytes;
  static constexpr int kVOff = kKOff + S * KTile::kBytes;
  static constexpr int kBarOff = kVOff + S * KTile::kBytes;
  static constexpr int kBarriers = 2 + 2 * kSlots + 4 * S;
  static constexpr int kSlotOff = kBarOff + kBarriers * 8;
  static constexpr int kBytes = kSlotOff + kSlots * static_cast<int>(sizeof(Slot)) + 1024;  // + the alignment slack

  char* base;
  __device__ __forceinline__ QTile q() const { return QTile{base}; }
  __device__ __forceinline__ QTile o() const { return QTile{base + kOOff}; }
  __device__ __forceinline__ KTile k(int s) const { return KTile{base + kKOff + s * KTile::kBytes}; }
  __device__ __forceinline__ KTile v(int s) const { return KTile{base + kVOff + s * KTile::kBytes}; }
  __device__ __forceinline__ uint64_t* bar(int i) const { return reinterpret_cast<uint64_t*>(base + kBarOff) + i; }
  __device__ __forceinline__ uint64_t* q_full() const { return bar(0); }
  __device__ __forceinline__ uint64_t* q_empty() const { return bar(1); }
  __device__ __forceinline__ uint64_t* tile_full(int s) const { return bar(2 + s); }
  __device__ __forceinline__ uint64_t* tile_empty(int s) const { return bar(2 + kSlots + s); }
  __device__ __forceinline__ uint64_t* k_full(int s) const { return bar(2 + 2 * kSlots + s); }
  __device__ __forceinline__ uint64_t* k_empty(int s) const { return bar(2 + 2 * kSlots + S + s); }
  __device__ __forceinline__ uint64_t* v_full(int s) const { return bar(2 + 2 * kSlots + 2 * S + s); }
  __device__ __forceinline__ uint64_t* v_empty(int s) const { return bar(2 + 2 * kSlots + 3 * S + s); }
  __device__ __forceinline__ Slot* tile_slot(int s) const { return reinterpret_cast<Slot*>(base + kSlotOff) + s; }

  // By one thread, before a CTA barrier. The "empty" barriers take one arrival per
  // consumer warp (its lane 0, after the warp is done with the buffer), but for the tile
  // slots': one per consumer thread, each after its own read of the slot (with one per
  // warp, compute-sanitizer's racecheck saw the other lanes' reads unordered before the
  // producer's next write, __syncwarp notwithstanding).
  __device__ __forceinline__ void init_barriers() const {
    constexpr int kConsumerWarps = Cfg::kConsumerThreads / 32;
    mbar_init(q_full(), 1);
    mbar_init(q_empty(), kConsumerWarps);
    for (int s = 0; s < kSlots; ++s) {
      mbar_init(tile_full(s), 1);
      mbar_init(tile_empty(s), Cfg::kConsumerThreads);
    }
    for (int s = 0; s < S; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), kConsumerWarps);
      mbar_init(v_empty(s), kConsumerWarps);
    }
    mbar_init_fence();
  }

  // The n-th query tile of the CTA (n counts from 0 over its life), by the producer
  // (`leader` writes) to the consumers: its slot (FwdTileSlot). The slot is free once every
  // consumer thread has read what it held kSlots tiles before.
  __device__ __forceinline__ void send_tile(uint32_t n, const Slot& tile, bool leader) const {
    const Stage<kSlots> slot(n);
    mbar_wait(tile_empty(slot.index), slot.parity ^ 1u);
    if (leader) {
      *tile_slot(slot.index) = tile;
      mbar_arrive(tile_full(slot.index));  // a release: the slot is visible to whoever sees the phase
    }
  }
  // Its receipt, by every consumer thread.
  __device__ __forceinline__ Slot receive_tile(uint32_t n) const {
    const Stage<kSlots> slot(n);
    mbar_wait(tile_full(slot.index), slot.parity);
    const Slot tile = *tile_slot(slot.index);
    mbar_arrive(tile_empty(slot.index));
    // Every lane has finished the previous tile's epilogue, whose reads of O's buffer the
    // next epilogue's writes must follow.
    __syncwarp();
    return tile;
  }
};

// The producer (one warp, whose lane 0 issues every copy; the whole warp steps
// the walk) over the CTA's n-th query tile: Q, and the walk's key tiles from
// `top` down, the first of them kv-th of the CTA's life (kv ends past the
// tile's last), each buffer once its previous contents' readers released it.
// K of the first key tile goes before Q: with O in Q's buffer Q waits for the
// previous tile's epilogue, K only for its products. A tile with no key tile to
// visit (`top` not visited) loads nothing: Q's phase completes without bytes,
// so that its count stays the tile count on both sides.
template <class Cfg>
__device__ __forceinline__ void forward_sm90_produce(const FwdRuntime& rt, const FwdSm90Smem<Cfg>& sm,
                                                     KeyTileWalk<Cfg>& walk, int linear, int m0, int top,
                                                     uint32_t n, uint32_t& kv) {
  constexpr int S = Cfg::kStages;
  const bool leader = walk.lane == 0;
  const bool any = walk.visits(top);
  int kc[3], vc[3];
  rt.tma_k.instance_coords(linear, kc);
  rt.tma_v.instance_coords(linear, vc);
  auto load_k = [&](uint32_t i, int n0) {
    const Stage<S> st(i);
    mbar_wait(sm.k_empty(st.index), st.parity ^ 1u);
    if (leader) {
      mbar_arrive_expect_tx(sm.k_full(st.index), Cfg::KTile::kBytes);
      tma_load_tile(rt.tma_k, kc, sm.k_full(st.index), sm.k(st.index), n0);
    }
  };
  if (any) load_k(kv, top);

  mbar_wait(sm.q_empty(), (n & 1u) ^ 1u);
  if (leader) {
    if (any) {
      int qc[3];
      rt.tma_q.instance_coords(linear, qc);
      mbar_arrive_expect_tx(sm.q_full(), Cfg::QTile::kBytes);
      tma_load_tile(rt.tma_q, qc, sm.q_full(), sm.q(), m0);
    } else {
      mbar_arrive(sm.q_full());
    }
  }

#pragma unroll 1
  for (int n0 = top; walk.visits(n0); ++kv) {
    const int next = walk.next(n0);
    if (walk.visits(next)) load_k(kv + 1, next);
    const Stage<S> st(kv);
    mbar_wait(sm.v_empty(st.index), st.parity ^ 1u);
    if (leader) {
      mbar_arrive_expect_tx(sm.v_full(st.index), Cfg::KTile::kBytes);
      tma_load_tile(rt.tma_v, vc, sm.v_full(st.index), sm.v(st.index), n0);
    }
    n0 = next;
  }
}

// One consumer warpgroup (wg = 0 .. kConsumers - 1, warp-uniform; tid its thread index,
// 0..127) over the walk's key tiles from `top` down (at least one) of the CTA's n-th
// query tile: on return o holds its rows' unnormalised output and st their softmax
// state. The first key tile is the kv-th of the CTA's life; kv ends past the last. ops: the
// instance's dropout seed words (Cfg::kDropout), or the score modifiers' operands
// (the copies with modifiers: segment ids, ALiBi's slope). Rounds 0 and n are peeled off, so
// that no product is issued under a condition.
template <class Cfg>
__device__ __forceinline__ void forward_sm90_consume(const AttentionParams& p, const FwdRuntime& rt,
                                                     const Positions& pos, const FwdSm90Smem<Cfg>& sm,
                                                     KeyTileWalk<Cfg>& walk,
                                                     const FwdOperands<typename Cfg::T>& ops, int m0, int top,
                                                     Acc<Cfg::kHeadDim>& o, typename Cfg::State& st, int wg, int tid,
                                                     uint32_t n, uint32_t& kv, FwdStamps& stamps) {
  using T = typename Cfg::T;
  constexpr int BN = Cfg::kBlockN, D = Cfg::kHeadDim, S = Cfg::kStages;
  const int lane = tid % 32, warp = tid / 32;
  const int wg_row0 = m0 + 64 * wg;            // the warpgroup's first query row
  const int warp_row0 = wg_row0 + 16 * warp;  // the warp's accumulator rows
  const FullTiles<BN> full(pos, wg_row0, min(wg_row0 + 64, pos.q_len) - 1);
  // The first tile loaded (the top one) may hold keys in [kv_len, S) that a
  // sequence length hides: zeroed before its P V (zero_rows: 0 * (inf or NaN)
  // in the padding would reach O).
  const int pad_end = min(top + BN, static_cast<int>(p.seqlen_k));
  const bool zero_v = pos.kv_len < pad_end;
  // Warpgroup 0 zeroes them; the warpgroups that read V (those whose rows start before the
  // query length: forward_sm90_pass reads none) meet it at a barrier of their own threads.
  // They reach it from whichever round is their first to read V (with kSplitMaskLoops a
  // warpgroup whose first tile is masked and one whose first tile is whole are in different
  // loops), so it is the unaligned barrier: with bar.sync, compute-sanitizer's synccheck
  // reported divergent threads (D = 64 ALiBi, bottom-right causal with lengths).
  const int v_readers = 128 * min(Cfg::kConsumerThreads / 128, (pos.q_len - m0 + 63) / 64);

  const GmmaOperand<typename Cfg::QTile, false> q_op(sm.q(), 64 * wg);
  Acc<BN> s;
  uint32_t pa[BN / 16][4];  // P of the previous round, the A operand of O += P V
  float alpha[2];  // the rows' rescaling factors of the last softmax
  // The soft-cap copy's factor inside the tanh (its launcher set exp_scale to the cap: tile
  // scores are tanh(s scale / cap)); in the copy's base-2 units as score.h's soft_cap_scores.
  const float cap_mul = Cfg::kMods == FwdMods::kSoftCap ? rt.score_mul / rt.softcap2 : 0.f;
  // Dropout: the lane's two row keys, hashed once for all key tiles.
  const DropoutKey dropout = Cfg::kDropout ? make_dropout_key(p, ops.seed) : DropoutKey{};
  const FragRowKeys<1> dropout_rows(dropout, Cfg::kDropout ? warp_row0 : 0, lane);

  // Round i's buffers: the kv + i-th of the CTA's life.
  auto wait_k = [&](int i) {
    const Stage<S> st(kv + i);
    mbar_wait(sm.k_full(st.index), st.parity);
  };
  auto wait_v = [&](int i) {
    const Stage<S> st(kv + i);
    mbar_wait(sm.v_full(st.index), st.parity);
    if (i == 0 && zero_v) {
      if (wg == 0) {
        zero_rows(sm.v(st.index), pos.kv_len - top, pad_end - top, tid, 128);
        fence_proxy_async_shared();  // the zeros, before the tensor cores read them
      }
      named_sync_unaligned(kZeroVBarrier, v_readers);
    }
  };
  // With kPingPong a warpgroup issues only in its turn and then hands the
  // turn over; warpgroup 1's last turn has no successor.
  auto begin_turn = [&] {
    if constexpr (Cfg::kPingPong) named_sync(kTurnBarrier + wg, Cfg::kConsumerThreads);
    wgmma_fence();
  };
  auto end_turn = [&](bool last_turn) {
    if constexpr (Cfg::kPingPong)
      if (!(last_turn && wg == 1)) named_arrive(kTurnBarrier + (1 - wg), Cfg::kConsumerThreads);
  };
  auto issue_s = [&](int i) {
    const GmmaOperand<typename Cfg::KTile, false> k_op(sm.k(Stage<S>(kv + i).index), 0);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) wgmma_ss<T, BN, false, false>(s, q_op.step(kk), k_op.step(kk), kk > 0);
    wgmma_commit();
  };
  auto issue_pv = [&](int i) {
    const GmmaOperand<typename Cfg::KTile, true> v_op(sm.v(Stage<S>(kv + i).index), 0);
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) wgmma_rs<T, D, true>(o, pa[j], v_op.step(j), true);
    wgmma_commit();
  };
  // S_i (keys n0..) has landed: release K_i, mask, softmax.
  auto softmax = [&](int i, int n0, auto mask_step) {
    hold_acc(s);
    mbar_arrive_if(sm.k_empty(Stage<S>(kv + i).index), lane == 0);
    if constexpr (Cfg::kGeneral) {
      score_tile<Cfg>(s, p, rt, pos, ops, warp_row0, n0, full.contain(n0), walk.needs_id_test(n0), lane);
    } else {  // the plain and dropout copies, and one modifier's: its step, then the masks
      if constexpr (Cfg::kMods == FwdMods::kSoftCap) tanh_scores<T>(s, cap_mul);
      if constexpr (Cfg::kMods == FwdMods::kAlibi) alibi_scores(s, warp_row0 + pos.offset - n0, 1.f, ops.alibi2, lane);
      if constexpr (decltype(mask_step)::value == kMaskAlways) {
        mask_positions(s, BlockWindow(pos, warp_row0, n0), lane);
      } else if constexpr (decltype(mask_step)::value == kMaskTest) {
        if (!full.contain(n0)) mask_positions(s, BlockWindow(pos, warp_row0, n0), lane);
      }
      if constexpr (Cfg::kMods == FwdMods::kSegmentIds && decltype(mask_step)::value != kMaskNever)
        if (walk.needs_id_test(n0)) segment_id_scores(s, p, pos, ops, warp_row0, n0, lane);
    }
    softmax_update<Cfg::kExp2PolyEvery>(s, st, rt.exp_scale, rt.p_shift, [&](int, int h, float a) { alpha[h] = a; });
    // After the softmax's sums: dropout changes what reaches O, not the normaliser.
    if constexpr (Cfg::kDropout) drop_probabilities(s, dropout, dropout_rows, n0, lane);
  };
  auto to_p = [&] {
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) a_operand<T>(pa[j], s, j);
  };
  // O += P_i V_i has landed: release V_i.
  auto pv_done = [&](int i) {
    hold_acc(o);
    mbar_arrive_if(sm.v_empty(Stage<S>(kv + i).index), lane == 0);
  };

  // This warpgroup's own keys (Cfg::kSkipUnseen, tile_size.h): the walk covers what any of the
  // query tile's rows sees, but under causal masking the top tiles can lie wholly right of its
  // 64 rows' diagonal (at D = 64 a 192-row tile over 128-key tiles: ~10% of the products at
  // N = 1k), and under a window the bottom ones left of its rows' reach. Such a round is passed
  // (its buffers released unread, its turn taken) instead of computed: a fully masked tile adds
  // exact zeros, so the result is bitwise the same (but for a NaN in V there, which 0 * NaN no
  // longer spreads to these rows: README's NaN rule, a key a row cannot see is not read for
  // it). Not where V_0's padding is zeroed (zero_v): its readers meet at one barrier, from one
  // place.
  const int wg_hi = min(pos.kv_len, min(wg_row0 + 64, pos.q_len) - 1 + pos.offset + pos.window_right + 1);
  const int wg_lo = wg_row0 + pos.offset - pos.window_left;
  auto unseen = [&](int n0) { return Cfg::kSkipUnseen && (n0 >= wg_hi || n0 + BN <= wg_lo); };
  auto pass_k = [&](int i) {
    wait_k(i);
    mbar_arrive_if(sm.k_empty(Stage<S>(kv + i).index), lane == 0);
  };
  auto pass_v = [&](int i) {
    wait_v(i);
    mbar_arrive_if(sm.v_empty(Stage<S>(kv + i).index), lane == 0);
  };
  // A passed round r: K_r (but round n's), V_{r - 1} (but round 0's), the turn.
  auto pass_round = [&](int r, bool has_k) {
    if (has_k) pass_k(r);
    if (r > 0) pass_v(r - 1);
    if constexpr (Cfg::kPingPong) named_sync(kTurnBarrier + wg, Cfg::kConsumerThreads);
    end_turn(!has_k);
  };

  mbar_wait(sm.q_full(), n & 1u);
  stamps.now(kFtQWait + 1);
  // Warpgroup 0 goes first. Each query tile's turns balance on both barriers
  // (warpgroup 1's last turn hands over none), so the next tile starts afresh.
  if (Cfg::kPingPong && wg == 1) named_arrive(kTurnBarrier + 0, Cfg::kConsumerThreads);

  int r = 0, n0 = top;
  if (!zero_v)
    for (; walk.visits(n0) && unseen(n0); n0 = walk.next(n0), ++r) pass_round(r, true);
  // (Without kSkipUnseen every tile of the walk is computed: the conditions below are then
  // constants, and the code reduces to one tested loop.)
  if (!Cfg::kSkipUnseen || walk.visits(n0)) {
    wait_k(r);  // the first tile the rows see: S alone
    begin_turn();
    issue_s(r);
    end_turn(false);
    stamps.now(kFtFirstS + 1);
    if (Cfg::kSkipUnseen && r > 0) pass_v(r - 1);
    wgmma_wait<0>();
    softmax(r, n0, MaskStep<kMaskTest>{});
    to_p();
    // the next ones: S_r, then P_{r-1} V_{r-1}
    auto round = [&](auto mask_step) {
      wait_k(r);
      wait_v(r - 1);
      begin_turn();
      issue_s(r);
      issue_pv(r - 1);
      end_turn(false);
      wgmma_wait<1>();
      softmax(r, n0, mask_step);
      if constexpr (Cfg::kSoftmaxBesidePv)
        wgmma_wait_in_order<0>(static_cast<uint32_t>(p.seqlen_k));
      else
        wgmma_wait<0>();
      pv_done(r - 1);
      rescale_row(o, 0, 0, alpha[0]);
      rescale_row(o, 0, 1, alpha[1]);
      to_p();
    };
    auto more = [&] { return walk.visits(n0) && !unseen(n0); };
    // A round with nothing to mask: every row sees the tile whole, and no id differs (the ids'
    // copy's lean loop: its per-element test, 64 loads, stays in the masked one).
    auto unmasked = [&] { return full.contain(n0) && !walk.needs_id_test(n0); };
    if constexpr (!Cfg::kSplitMaskLoops) {
#pragma unroll 1
      for (n0 = walk.next(n0), ++r; more(); n0 = walk.next(n0), ++r) round(MaskStep<kMaskTest>{});
    } else {
      n0 = walk.next(n0), ++r;
#pragma unroll 1
      for (;;) {  // (top down: the diagonal's tiles, the whole ones, a window's far edge)
#pragma unroll 1
        for (; more() && !unmasked(); n0 = walk.next(n0), ++r) round(MaskStep<kMaskAlways>{});
#pragma unroll 1
        for (; more() && unmasked(); n0 = walk.next(n0), ++r) round(MaskStep<kMaskNever>{});
        if (!more()) break;
      }
    }
    // Every S product is done (the last softmax read it): with O in a buffer of its own
    // nothing reads Q any more, and the next tile's may load during the last P V and
    // the epilogue.
    if constexpr (Cfg::kSeparateO) mbar_arrive_if(sm.q_empty(), lane == 0);
    const bool tail = Cfg::kSkipUnseen && walk.visits(n0);  // tiles left of the rows' window follow
    stamps.now(kFtRounds + 1);
    wait_v(r - 1);  // the last P V
    begin_turn();
    issue_pv(r - 1);
    end_turn(!tail);
    if (tail) pass_k(r);
    wgmma_wait<0>();
    pv_done(r - 1);
    stamps.now(kFtLastPv + 1);
    if (tail)
      for (n0 = walk.next(n0), ++r;; n0 = walk.next(n0), ++r) {
        const bool has_k = walk.visits(n0);
        pass_round(r, has_k);
        if (!has_k) break;
      }
  } else {  // no tile the rows see: O = 0, lse = -inf, as for fully masked rows
    if constexpr (Cfg::kSeparateO) mbar_arrive_if(sm.q_empty(), lane == 0);
    pass_round(r, false);
  }
  kv += r;
}

// A consumer warpgroup whose 64 rows are all at or past the instance's query length
// (the last tile of a sequence that BLOCK_M does not divide: at D = 64, N = 1k, the
// last 192-row tile has 64 rows): it computes nothing, and its rows keep O = 0 and
// lse = -inf, as fully masked rows do. It keeps forward_sm90_consume's protocol (the
// same waits, arrivals and ping-pong turns, round by round; not the zeroed-V barrier, which
// is the readers' of V), so that every
// stage is released and the other consumers' turns and barriers come as they would.
// Its arrivals may come before the computing warpgroups' do: each follows its wait
// for the stage's phase, which is the one the producer counts them towards.
template <class Cfg>
__device__ __forceinline__ void forward_sm90_pass(const FwdSm90Smem<Cfg>& sm, KeyTileWalk<Cfg>& walk,
                                                  int top, int wg, int lane, uint32_t n, uint32_t& kv) {
  constexpr int S = Cfg::kStages;
  auto pass_k = [&](int i) {
    const Stage<S> st(kv + i);
    mbar_wait(sm.k_full(st.index), st.parity);
    mbar_arrive_if(sm.k_empty(st.index), lane == 0);
  };
  auto pass_v = [&](int i) {
    const Stage<S> st(kv + i);
    mbar_wait(sm.v_full(st.index), st.parity);
    mbar_arrive_if(sm.v_empty(st.index), lane == 0);
  };
  auto turn = [&](bool last_turn) {
    if constexpr (Cfg::kPingPong) {
      named_sync(kTurnBarrier + wg, Cfg::kConsumerThreads);
      if (!(last_turn && wg == 1)) named_arrive(kTurnBarrier + (1 - wg), Cfg::kConsumerThreads);
    }
  };

  mbar_wait(sm.q_full(), n & 1u);
  if (Cfg::kPingPong && wg == 1) named_arrive(kTurnBarrier + 0, Cfg::kConsumerThreads);
  pass_k(0);  // round 0
  turn(false);
  int r = 1;
#pragma unroll 1
  for (int n0 = walk.next(top); walk.visits(n0); n0 = walk.next(n0), ++r) {  // rounds 1 .. n - 1
    pass_k(r);
    pass_v(r - 1);
    turn(false);
  }
  if constexpr (Cfg::kSeparateO) mbar_arrive_if(sm.q_empty(), lane == 0);
  pass_v(r - 1);  // round n
  turn(true);
  kv += r;
}

}  // namespace jaxflash::gpu
