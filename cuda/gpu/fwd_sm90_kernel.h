// The sm_90 forward kernel: FlashAttention-3's warp specialisation on
// Hopper, for the cases tile_size.h's fwd_sm90_covers names (16-bit, D = 64 /
// 128 / 256) under kernel_traits.h's fwd_sm90_case (no bias or mask; dropout
// or the score modifiers, each in a copy of the kernel).
//
// Persistent: one CTA per SM (at most one per query tile: fwd_launch.h)
// computes query tile after query tile. The tile indices keep fwd_schedule.h's
// order: a CTA starts at its blockIdx.x and then takes the next index not yet
// taken from an atomic counter (next_persistent_tile), so the tiles start in
// order (longest first under causal masking) and each on the CTA free first.
// A CTA is 1 + BLOCK_M / 64 warpgroups:
//   warpgroup 0: the producer. One thread (with segment ids one warp, which
//                steps the key tiles: KeyTileWalk) takes the tile indices, hands
//                each to the consumers through a ring of shared-memory slots
//                (FwdSm90Smem::send_tile; with segment ids the walk it started
//                goes along), then loads that tile: it issues
//                every TMA load (Q, the K / V tiles through the mbarrier
//                pipeline). The rest of the warpgroup leaves at once; it gives
//                its registers to the consumers (setmaxnreg).
//   warpgroups 1, 2 (, 3): consumers of 64 query rows each: the wgmma products, the
//                online softmax, and the epilogue of their rows.
// The producer runs ahead as far as the buffers let it: the next tile's Q loads
// once the current tile's last S product is done (O has a buffer of its own,
// tile_size.h's kSeparateO; at D = 256, once its epilogue is), its K / V tiles as
// the current tile's products release the stages, so the next tile's pipeline
// fill overlaps the current tile's last products and its epilogue.
// fwd_sm90_mainloop.h has the two roles' work on one tile; the epilogue is the
// mma.sync kernel's (fwd_epilogue.h), a consumer warp's 16 rows being one of its
// warps' m16 fragment: wgmma's accumulator layout is mma.sync's.
//
// Why it cannot deadlock: every wait has a party that will arrive.
//  - Consumers, tile_full of the n-th tile: the producer sends every index it
//    takes and, last, one >= rt.tiles, after which the consumers return. Before
//    sending it waits for tile_empty of tile n - kTileSlots, on which every
//    consumer thread arrived on receiving that tile, waiting for nothing else.
//  - Consumers, q_full (phase n): the producer completes it for every tile it
//    sends (Q's bytes, or its arrival alone for a tile that loads nothing), after
//    q_empty (phase n - 1), on which every consumer warp arrives within tile
//    n - 1, after its last S product or its epilogue, before waiting for q_full.
//  - Consumers, k_full / v_full: the producer loads exactly the key tiles the
//    consumers walk (the same KeyTileWalk), in their order, the CTA's i-th into
//    the stage that the consumers released of the (i - kStages)-th, which they
//    do as they finish it, waiting only for loads issued before.
//  - The producer's waits on the "empty" barriers are such releases.
//  - Every load the producer issues is for a tile the consumers receive, and
//    they wait for its bytes, so no TMA load is in flight when the CTA exits;
//    after the end index the producer issues nothing.
//  - Named barriers are the consumers' alone: each tile's ping-pong turns
//    balance (fwd_sm90_mainloop.h), and every consumer thread syncs on the
//    zeroing one for the same tiles.
// Every tile's arithmetic is the non-persistent kernel's: only the order the
// tiles run in changed, so the results are bitwise the same.
#pragma once

#include <cstdint>

#include "fwd_epilogue.h"
#include "fwd_schedule.h"
#include "fwd_sm90_mainloop.h"
#include "instance.h"
#include "kernel_traits.h"
#include "primitives/positions.h"
#include "primitives/softmax.h"
#include "primitives/tma.h"
#include "primitives/wgmma.h"
#include "tile_size.h"
#include "timeline.h"
#include "../params.h"

namespace jaxflash::gpu {

// kDropout: a copy of the kernel with attention dropout, so that the copy
// without keeps its registers. kMods: the copies that rewrite the scores before
// the softmax (tile_size.h's FwdMods): the soft-cap's, ALiBi's and the segment
// ids' alone, and the general one, which runs the mma.sync general variant's
// score step (fwd_scores.h's score_tile) over any mix of them and a folded scale
// (a scale operand, scale <= 0). The copies with segment ids skip the key tiles
// that cannot meet the query tile (fwd_sm90_mainloop.h's KeyTileWalk). Not with
// dropout (forward.cu). kWideKeys: 160-key tiles (tile_size.h), for long keys
// at D = 128.
template <class T_, int D, bool kDropout_, FwdMods kMods_ = FwdMods::kNone, bool kWideKeys = false>
struct FwdSm90Config {
  using T = T_;
  static_assert(fwd_sm90_covers(sizeof(T), D), "see tile_size.h");
  static constexpr int kHeadDim = D;
  static constexpr bool kDropout = kDropout_;
  static constexpr FwdMods kMods = kMods_;
  static_assert(!(kDropout && kMods != FwdMods::kNone), "one copy or the other");
  static constexpr F32Mma kF32Mma = F32Mma::kTf32;  // (16-bit only: no float32 products)
  using State = SoftmaxState<1>;  // with each row's largest score (softmax_finalize)
  // What score_tile (fwd_scores.h) does over a warp's m16 x BLOCK_N block of S: in the general
  // copy its general steps and the segment ids' test; never a bias or a mask (fwd_sm90_case),
  // whose code would only cost registers. The other copies take their own steps
  // (fwd_sm90_mainloop.h, the consumer's softmax step).
  static constexpr bool kGeneral = kMods == FwdMods::kGeneral, kBiasMask = false;
  static constexpr bool kSegmentIds = kGeneral || kMods == FwdMods::kSegmentIds;
  // The copies that fold the scale into their step and so may run with a scale operand.
  static constexpr bool kScaleOperand = kGeneral || kMods == FwdMods::kSoftCap;
  static constexpr bool kAlibi = kGeneral || kMods == FwdMods::kAlibi;
  using Tiles = FwdSm90TileSize<D, kMods, kWideKeys>;
  static constexpr int kBlockM = Tiles::kBlockM;
  static constexpr int kBlockN = Tiles::kBlockN;
  static constexpr int kStages = Tiles::kStages;
  static constexpr bool kPingPong = Tiles::kPingPong;
  static constexpr bool kSkipUnseen = Tiles::kSkipUnseen;
  static constexpr bool kSplitMaskLoops = Tiles::kSplitMaskLoops;
  static constexpr bool kSeparateO = Tiles::kSeparateO;
  static constexpr int kTileSlots = Tiles::kTileSlots;
  static constexpr int kExp2PolyEvery = Tiles::kExp2PolyEvery;
  static constexpr bool kSoftmaxBesidePv = Tiles::kSoftmaxBesidePv;
  static constexpr int kConsumers = kBlockM / 64;  // warpgroups of 64 query rows
  static_assert(kBlockM % 64 == 0 && (!kPingPong || kConsumers == 2), "turns between two consumers");
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kThreads = 128 + kConsumerThreads;
  // Registers per thread after setmaxnreg (primitives/tma.h's balance): the
  // producer keeps 24; the consumers take the rest, at most 240: two get 240,
  // three 160.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = consumer_regs(kThreads, kConsumerThreads, kProducerRegs);
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= launch_regs(kThreads) * kThreads,
                "setmaxnreg cannot give out more registers than the launch allocated");
  static_assert(kConsumers != 2 || kConsumerRegs == 240, "the shape tile_size.h measured");
  static_assert(kConsumers != 3 || kConsumerRegs == 160, "the shape tile_size.h measured");
  using QTile = GmmaTile<T, kBlockM, D>;  // Q, and O on its way out
  using KTile = GmmaTile<T, kBlockN, D>;  // K and V
  static constexpr int kSmemBytes = FwdSm90Smem<FwdSm90Config>::kBytes;
  static_assert(kSmemBytes == fwd_sm90_smem_bytes<D, kMods, kWideKeys>(), "tile_size.h sizes the same layout");
  // The shape the epilogue (fwd_epilogue.h) sees: the consumer warps, one m16
  // fragment of rows each.
  static constexpr int kWarpRows = kFwdSm90WarpRows, kMF = 1, kDF = D / 8, kNF = kBlockN / 8;
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    forward_sm90_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ FwdRuntime launch_rt) {
#if JF_WGMMA
  using T = typename Cfg::T;
  constexpr int BM = Cfg::kBlockM;
  extern __shared__ char smem_raw[];
  const FwdSm90Smem<Cfg> sm{smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024)};

  const FwdRuntime& rt = launch_rt;
  // A tile's key tiles, which both roles walk alike.
  auto key_tiles = [&](const FwdTile& tile, const InstanceBounds& bounds) {
    const KeyRange keys = visible_keys(p, bounds, tile.m0, tile.m0 + BM);
    return KeyTileWalk<Cfg>(rt.segments, tile.linear, tile.m0, keys, threadIdx.x % 32);
  };

  const int tid = threadIdx.x;
  // The warpgroup, as a value ptxas knows to be warp-uniform (a shuffle from
  // lane 0): it serialises wgmma near branches it cannot prove uniform.
  const int warpgroup = __shfl_sync(0xffffffffu, tid / 128, 0);
  if (tid == 0) sm.init_barriers();
  __syncthreads();  // the only CTA-wide barrier: the producer leaves early

  if (warpgroup == 0) {
    regs_release<Cfg::kProducerRegs>();
    if (Cfg::kSegmentIds ? tid < 32 : tid == 0) {
      const bool leader = tid == 0;
      int index = static_cast<int>(blockIdx.x);
      // n: the CTA's tiles so far; kv: its key tiles loaded so far.
#pragma unroll 1
      for (uint32_t n = 0, kv = 0;; ++n) {
        if (index >= rt.tiles) {
          sm.send_tile(n, {index}, leader);  // the end
          return;
        }
        // Taken now and used after the tile's loads, which hide the atomic's latency.
        int next = leader ? next_persistent_tile(rt) : 0;
        const FwdTile tile = forward_tile<BM>(p, rt, index);
        KeyTileWalk<Cfg> walk = key_tiles(tile, instance_bounds(p, tile.linear));
        const int top = walk.start();
        if constexpr (Cfg::kSegmentIds) sm.send_tile(n, {index, walk.started(top)}, leader);
        else sm.send_tile(n, {index}, leader);
        forward_sm90_produce<Cfg>(rt, sm, walk, tile.linear, tile.m0, top, n, kv);
        if constexpr (Cfg::kSegmentIds) next = __shfl_sync(0xffffffffu, next, 0);
        index = next;
      }
    }
    return;
  }
  regs_acquire<Cfg::kConsumerRegs>();
  const int ctid = tid - 128;  // among the consumers: warpgroup ctid / 128, warp ctid / 32
  const int lane = tid % 32;
#ifdef JAXFLASH_FWD_TIMELINE
  unsigned long long prev_end = 0;  // the warpgroup's last computed tile's end (timeline.h)
#endif
  // n: the CTA's tiles so far; kv: its key tiles consumed so far.
#pragma unroll 1
  for (uint32_t n = 0, kv = 0;; ++n) {
    const typename FwdSm90Smem<Cfg>::Slot slot = sm.receive_tile(n);
    const int index = slot.index;
    FwdStamps stamps;
    stamps.now(0);
    if (index >= rt.tiles) {
      // The warp's last TMA stores of O, done before the CTA and its shared memory end.
      if (Cfg::kSeparateO && lane == 0) bulk_wait_all();
      return;
    }
    const FwdTile tile = forward_tile<BM>(p, rt, index);
    const InstanceBounds bounds = instance_bounds(p, tile.linear);
    const Positions pos(p, bounds);
    // The tile's walk: with segment ids the one the producer started (its slot), else the
    // consumers' own. No visible key for any row (or all rows padding), or no key tile that
    // shares an id with them: nothing is loaded, and the epilogue alone writes O = 0 and
    // lse = -inf.
    int top = 0;
    KeyTileWalk<Cfg> walk = [&](const auto& s) {
      if constexpr (Cfg::kSegmentIds) {
        top = s.walk.top;
        return KeyTileWalk<Cfg>(rt.segments, tile.linear, tile.m0, s.walk, lane);
      } else {
        KeyTileWalk<Cfg> own = key_tiles(tile, bounds);
        top = own.start();
        return own;
      }
    }(slot);
    const bool any = walk.visits(top);
    Acc<Cfg::kHeadDim> o;
    zero_frags(o);
    typename Cfg::State st;
    st.init();
#ifdef JAXFLASH_FWD_TIMELINE
    int rounds = 0;  // key tiles this warpgroup computed in the tile (0: passed or empty)
#endif
    // The consumers' work under runtime `crt`.
    auto consume = [&](const FwdRuntime& crt) {
      if (any) {
        // What the copies read beyond Q, K and V: the seed, or the score modifiers'. (The
        // instance's index is formed again for the epilogue: kept alive across the main loop,
        // it cost the dropout copy spills.)
        const InstanceIndex inst(p, tile.linear);
        FwdOperands<T> ops{};
        if constexpr (Cfg::kDropout) ops.seed = inst.origin<const uint32_t>(p, p.seed);
        if constexpr (Cfg::kSegmentIds) {
          if (p.has(kHasSegmentIds)) {
            ops.q_ids = inst.origin<const int32_t>(p, p.q_segment_ids);
            ops.kv_ids = inst.origin<const int32_t>(p, p.kv_segment_ids);
          }
        }
        // ALiBi's slope in the units of the scores the softmax takes, s exp_scale base-2 logits
        // (the general copy's: exp_scale 1; ALiBi's copy: raw q.k, exp_scale = score_mul).
        if constexpr (Cfg::kAlibi) ops.alibi2 = kLog2e * alibi_slope(p, tile.linear) / crt.exp_scale;
        const int wg = warpgroup - 1;
        if (tile.m0 + 64 * wg < pos.q_len) {
#ifdef JAXFLASH_FWD_TIMELINE
          const uint32_t kv0 = kv;
#endif
          forward_sm90_consume<Cfg>(p, crt, pos, sm, walk, ops, tile.m0, top, o, st, wg, ctid % 128, n, kv, stamps);
#ifdef JAXFLASH_FWD_TIMELINE
          rounds = static_cast<int>(kv - kv0);
#endif
        } else {  // rows all past the query length: nothing to compute
          forward_sm90_pass<Cfg>(sm, walk, top, wg, lane, n, kv);
        }
      } else {
        // Q's phase completed without a load: nothing to read, and with O in a buffer of
        // its own nothing to wait for before releasing it.
        mbar_wait(sm.q_full(), n & 1u);
        if constexpr (Cfg::kSeparateO) mbar_arrive_if(sm.q_empty(), lane == 0);
      }
      // With O in a buffer of its own (kSeparateO) each warp's 16 rows leave it by TMA stores
      // that the warp's lane 0 issues: the previous tile's must have read the rows before the
      // warp stages this one's there. Without, the warp stores them itself (fwd_epilogue.h).
      if constexpr (Cfg::kSeparateO) {
        if (lane == 0) bulk_wait_reads();
        __syncwarp();
      }
      const InstanceIndex inst(p, tile.linear);
      float* const lse_origin = p.lse.data != nullptr ? inst.origin<float>(p, p.lse) : nullptr;
      // Each warp stages O through its own 16 rows of O's buffer. Without kSeparateO that is
      // Q's, whose rows only the warp's warpgroup's products read, and those are complete;
      // the next Q may load once every warp is done with them (the generic proxy's accesses
      // ordered before the TMA's writes, the warp's lanes all done).
      // (Its addresses from opaque values: see opaque.)
      const typename Cfg::QTile so{opaque(sm.o().ptr)};
      if constexpr (Cfg::kSeparateO) {
        // (float32 O, kOutputF32, goes from registers to o_origin.)
        void* const o_origin = p.has(kOutputF32) ? static_cast<void*>(inst.origin<float>(p, p.o)) : nullptr;
        if (forward_epilogue_stage<Cfg>(p, crt, pos, o_origin, lse_origin, tile.m0, so, o, st, opaque(ctid))) {
          fence_proxy_async_shared();  // the staged rows, before the TMA reads them
          __syncwarp();
          if (lane == 0) {
            int oc[3];
            rt.tma_o.instance_coords(tile.linear, oc);
            const int warp_row = ctid / 32 * Cfg::kWarpRows;
            tma_store_rows(rt.tma_o, oc, so, warp_row, tile.m0 + warp_row);
            bulk_commit();
          }
        }
      } else {
        void* const o_origin =
            p.has(kOutputF32) ? static_cast<void*>(inst.origin<float>(p, p.o)) : inst.origin<T>(p, p.o);
        forward_epilogue<Cfg>(p, crt, pos, o_origin, lse_origin, tile.m0, so, o, st, opaque(ctid));
      }
#ifdef JAXFLASH_FWD_TIMELINE
      if (rounds > 0 && ctid % 128 == 0) {  // a computed tile, stamped by its warpgroup's first thread
        stamps.now(kFtEpilogue + 1);
        stamps.add(rt.timeline + (blockIdx.x % kTlCtas) * kFtRowWords, warpgroup - 1, prev_end, rounds);
        prev_end = stamps.t[kFtEpilogue + 1];
      }
#endif
      if constexpr (!Cfg::kSeparateO) {
        fence_proxy_async_shared();
        __syncwarp();
        mbar_arrive_if(sm.q_empty(), lane == 0);
      }
    };
    // A scale operand runs the copies that fold the scale only: the others read the launch's
    // runtime in place (a copy of it cost the dropout copy spills).
    if constexpr (Cfg::kScaleOperand) consume(with_scale_operand(p, rt, tile.linear));
    else consume(rt);
  }
#else
  (void)p, (void)launch_rt;
#endif
}

}  // namespace jaxflash::gpu
