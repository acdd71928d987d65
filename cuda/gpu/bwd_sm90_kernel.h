// The sm_90 backward kernel: the FlashAttention-2 backward of bwd_kernel.h
// (same grid, tickets, GQA loop, Q-tile range and dQ protocol) with every
// product on Hopper's warpgroup MMA (primitives/wgmma.h), for the cases of
// bwd_tile_size.h's sm_90 table (16-bit, D = 64 / 128, no bias or mask), with
// dropout or the score modifiers (soft-cap, ALiBi, segment ids) in copies of
// their own.
//
// Why a second kernel: the mma.sync backward feeds all five products from
// shared memory through ldmatrix, 8 warps per SM; it runs at 0.7-0.8 of
// FlashAttention-2 and is bound by the fragment loads' latency. wgmma reads
// shared memory itself, so the threads only do the element-wise work.
//
// Persistent: a CTA per SM takes (kept instance, key tile) items from the
// tickets until they run out (bwd_sm90_loads.h), so that one item's K / V load
// and the first Q tile's overlap the previous item's last tile and its dK / dV
// stores, which a CTA per item left exposed (~18 us of a 62 us CTA at D = 128,
// N = 1k on the H100: docs/DESIGN.md). Per item, 128 keys, warpgroup g the 64
// keys [64 g, 64 g + 64) of them; everything is computed *transposed*, keys
// as rows, so that the accumulators of its first products are the A operands
// of the next ones:
//
//   S^T  = K_g Q^T,   dP^T = V_g dO^T          SS, K-major  (64 x BLOCK_M)
//   P^T  = exp2(S^T scale log2e - lse2),  dS^T = P^T o (dP^T - delta)
//          (with dropout, bwd_scores.h's algebra: P^T o Z^T, c Z^T o dP^T)
//          lse2 is the lse's hi alone: its lo (params.h) is below what 16 bits
//          resolve in P (bwd_scores.h). (S^T = K Q^T is bitwise the forward's
//          S = Q K^T: wgmma sums the same products in the same order either way,
//          measured on an H200 for fp16 and bf16 at D = 64 / 128.) At logits of
//          1e4 the lo left out scales a row's P by up to 1 + 1e-3, which
//          test_numerics' large logits tolerate once the forward's normaliser is
//          consistent (softmax_finalize). Subtracting lo cost 2-3.5% here.
//   dV_g += P^T dO,   dK_g += dS^T Q           RS, B MN-major (64 x D)
//   dS^T -> shared memory; barrier
//   dQ  (its 16 x 64 blocks) = dS K            SS, both MN-major
//   dQ  -> a shared-memory stage, for the writer
//
// Overlap inside a warpgroup: dP^T runs while P^T is computed, dV while dS^T
// is, and the last sub-tile's dK while dQ goes to the writers. The two
// warpgroups meet at two barriers per Q tile (the tile has landed and the
// previous one's dS^T is no longer read; dS^T is complete); at D = 128, with
// two dS^T buffers (bwd_sm90_ds_stages), only at the second, unless the tile
// zeroed rows.
//
// The loads: a producer warp (warp 0 of the third warpgroup) fills a two-stage
// ring with each Q tile's Q and dO (TMA), lse2 and delta (bulk copies) and row
// words (bwd_sm90_loads.h), so the next tile loads during the whole current
// one and the consumers carry no load addressing, and K / V (TMA) once per item
// as soon as the consumers release the previous ones. Rows in [q_len, T) (and
// keys in [kv_len, S)) that a sequence length hides are inside the tensor, so
// the TMA reads them: the consumers zero them (zero_rows) before the tile's
// barrier, as cp.async's zero fill did. dK / dV go from the consumers'
// registers straight to global memory (store_key_rows), so K / V's shared
// memory is free for the next item's load during the epilogue.
//
// The dQ writers: a thread of the third warpgroup (the first of warp 1, and of
// warp 2: one per dQ stage, BwdSm90Config::kDqWriters) adds each
// staged dQ tile to the accumulator in the tile's turn (bwd_dq.h's protocol), so the
// consumers never wait for another CTA's turn nor pay the GPU-scope release
// of their own: on the H100 those were ~30% of the consumer warps' stall
// samples (D = 128, N = 4k) when the warps did it themselves. The stage is
// double buffered (mbarriers full / empty); the warpgroup gives its registers
// to the consumers (setmaxnreg), as the forward's producer does. A writer
// walks the consumers' Q tiles itself, except in the segment-id copy, where the
// consumers name each staged tile and its turn (DqTurn, from the producer's
// QTilePlan): they skip tiles, and so the writers add exactly the tiles they
// computed without a loop of their own to agree with theirs.
//
// The score modifiers (BwdSm90Config::kScoreMods, segment ids kSegmentIds; params.h's
// order: soft-cap, then ALiBi and the masks), on the transposed accumulator, keys as rows:
//   soft-cap  t = tanh(S^T scale / cap) on the SFU (soft_cap_tanh: one MUFU op
//             beside exp2's, where tanhf is ~20 instructions per score), the
//             base-2 logit log2e cap t; dS^T is multiplied by the slope
//             (1 - t)(1 + t), kept per score from P^T to dS^T. Why the
//             approximation is enough in 16 bits: its ~2^-11 relative error
//             moves the capped logit by ~2^-11 |logit|, what rounding the logit
//             to fp16 would (a quarter of bf16's), so P by as much relative:
//             below bf16's rounding of P (2^-9) for |logit| < 4, the slope's
//             error (~2^-10 absolute) below bf16's rounding of dS^T. fp16 P
//             resolves 2^-12, finer than the cap's error from |logit| ~ 0.5 on
//             (docs/DESIGN.md: to check against the tests' rule on the GPU).
//   ALiBi     -log2e slope |key - query - offset|: alibi.h's fragment helper,
//             whose distance |col - row - diag| is, with rows and columns
//             swapped, |row - col + diag|, so it takes -diag.
//   segments  a Q tile whose id range cannot meet the key tile's is not visited
//             (segment_tiles.h: not loaded, no turn taken, and the dQ turns of
//             the tiles visited count only key tiles that meet, as in
//             bwd_kernel.h; the producer's QTilePlan says which); a pair whose
//             ranges are not one id gets the per-element test: each lane's two
//             key ids are loaded once per instance, and only such a tile's
//             queries' ids come with it into shared memory.
#pragma once

#include <cstdint>

#include "bwd_dq.h"
#include "bwd_key_tile.h"
#include "bwd_kernel_traits.h"
#include "bwd_scores.h"
#include "bwd_sm90_loads.h"
#include "instance.h"
#include "timeline.h"
#include "primitives/alibi.h"
#include "primitives/smem_tile.h"
#include "primitives/tma.h"
#include "primitives/wgmma.h"
#include "../params.h"

namespace jaxflash::gpu {

// kDropout: a copy of the kernel with dropout, so that the copy without keeps
// its registers (the dropout's state adds ~50-100 bytes of spills).
// kScoreMods: a copy with the soft-cap and ALiBi, run-time values picking
// which apply, so that the plain copy keeps its registers (the soft-cap's slopes
// alone are 32 per thread). Not with dropout: backward.cu runs that combination
// on the mma.sync general kernel. kSegmentIds: segment ids, alone or with
// kScoreMods, whose machinery (the Q tiles skipped by the producer's plan, the key
// rows' ids, the turns named to the writers) a call without ids does not pay for,
// and packed documents without a soft-cap or ALiBi not the registers of those.
template <class T_, int D, bool kDropout_, bool kScoreMods_ = false, bool kSegmentIds_ = false>
struct BwdSm90Config {
  using T = T_;
  static_assert(bwd_sm90_covers(sizeof(T), D), "see bwd_tile_size.h");
  static constexpr int kHeadDim = D;
  static constexpr bool kDropout = kDropout_;
  static constexpr bool kScoreMods = kScoreMods_;
  static constexpr bool kSegmentIds = kSegmentIds_;
  static_assert(!(kDropout && kScoreMods), "dropout with score modifiers runs the mma.sync kernel");
  static constexpr int kBlockM = bwd_sm90_block_m(D), kBlockN = kBwdSm90BlockN;
  static constexpr int kConsumerThreads = 256;  // two warpgroups
  static constexpr int kThreads = 128 + kConsumerThreads;  // and the producer's and dQ writer's
  static constexpr int kConsumerBarrier = 1;  // the consumers' named barrier
  // dQ writers: one per dQ stage, so that a tile's reduction completes and its turn is
  // signalled while the other stage's tile goes out (a turn's reduction takes ~1.7 us to its
  // release, against ~2.9 us for a Q tile's products at D = 128: one writer was busy ~77% of
  // the time and held the consumers back once they got faster).
  static constexpr int kDqWriters = 2;
  // Registers per thread after setmaxnreg (primitives/tma.h's balance): the
  // producer's and writer's warpgroup keeps 24 (no fewer: a producer at too few
  // hung the H100 in the forward), the consumers get 240.
  static constexpr int kWriterRegs = 24;
  static constexpr int kConsumerRegs = consumer_regs(kThreads, kConsumerThreads, kWriterRegs);
  static_assert(kConsumerRegs == 240, "the registers bwd_tile_size.h counts on");
  static_assert(128 * kWriterRegs + kConsumerThreads * kConsumerRegs <= launch_regs(kThreads) * kThreads,
                "setmaxnreg cannot give out more registers than the launch allocated");
  static constexpr int kGroupKeys = kBlockN / 2;
  static constexpr int kSubM = 64;  // queries per S^T / dP^T product
  static constexpr BwdDqGrid kDq = bwd_sm90_dq_grid(D);
  // dQ's split between the warpgroups: by rows (BLOCK_M = 128) or columns.
  static constexpr bool kDqSplitRows = kBlockM == 128;
  static_assert(kDqSplitRows != (D == 128), "each warpgroup computes a 64 x 64 block of dQ");

  using QTile = GmmaTile<T, kBlockM, D>;        // Q and dO
  using KTile = GmmaTile<T, kBlockN, D>;        // K and V (then dK, dV on the way out)
  using DsTile = GmmaTile<T, kBlockN, kBlockM>;  // dS^T, [key][query]
  static constexpr int kDsStages = bwd_sm90_ds_stages(D);  // Q tile n writes buffer n % kDsStages
  // Offsets from the 1024-byte aligned base: Q / dO of stage s at 2 s (2 s + 1)
  // QTile::kBytes, then K, V, dS^T's buffers, lse2 / delta of stage s at kStatsOff +
  // (2 s, 2 s + 1) BLOCK_M floats, the Q tile's row words of stage s at
  // kRowWordsOff + s BLOCK_M words (the dropout's row keys, or with kSegmentIds
  // the queries' segment ids), the two dQ stages, their mbarriers (full 0, 1,
  // empty 0, 1), their DqTurns, then the loads' mbarriers and item slots
  // (QTileStages: the Q-tile stages' full 0, 1, empty 0, 1, K / V's full and
  // empty, the item slots' full 0, 1 and empty 0, 1, then the two slots and the
  // stages' two QTilePlans).
  static constexpr int kKOff = 4 * QTile::kBytes, kVOff = kKOff + KTile::kBytes, kDsOff = kVOff + KTile::kBytes;
  static constexpr int kStatsOff = kDsOff + kDsStages * DsTile::kBytes;
  static constexpr int kRowWordsOff = kStatsOff + 4 * kBlockM * 4;
  static constexpr int kDqStageOff = kRowWordsOff + 2 * kBlockM * 4;
  static constexpr int kDqTileFloats = kBlockM * D;
  static constexpr int kDqBarsOff = kDqStageOff + 2 * kDqTileFloats * 4;
  static constexpr int kDqTurnsOff = kDqBarsOff + 4 * 8;
  static constexpr int kLoadBarsOff = kDqTurnsOff + 2 * 16;
  static constexpr int kSmemBytes = kLoadBarsOff + 10 * 8 + 2 * 16 + 2 * 16 + 1024;
  static_assert(kSmemBytes == bwd_sm90_smem_bytes(D), "bwd_tile_size.h sizes the same layout");
};

// -inf outside the visible keys, for an accumulator whose rows are keys and
// columns queries: blk is the block as (queries from row0) x (keys from col0).
template <int NF>
__device__ __forceinline__ void mask_positions_transposed(float (&s)[1][NF][4], const ScoreBlock& blk, int lane) {
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int q = frag_col(nf, c, lane);
      const int lo = q + blk.lo, hi = q < blk.q_end ? min(q + blk.hi, blk.kv_end) : lo;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = frag_row(0, 2 * h, lane);
        if (key < lo || key >= hi) s[0][nf][2 * h + c] = -INFINITY;
      }
    }
}

// -inf where the query's and the key's segment ids differ, for an accumulator
// whose rows are keys and columns queries: key_ids[h] is the id of the lane's
// row 8 h + lane / 4, q_ids those of the block's queries (shared memory; the
// lane's two adjacent columns in one 8-byte load). Positions past the lengths
// are left to the position mask and to lse2 = +inf (their ids are not read).
template <int NF>
__device__ __forceinline__ void apply_segment_ids_transposed(float (&s)[1][NF][4], const int32_t (&key_ids)[2],
                                                             const int32_t* q_ids, int lane) {
#pragma unroll
  for (int nf = 0; nf < NF; ++nf) {
    const int2 query = *reinterpret_cast<const int2*>(q_ids + frag_col(nf, 0, lane));
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if ((e & 1 ? query.y : query.x) != key_ids[e >> 1]) s[0][nf][e] = -INFINITY;
  }
}

// One staged dQ tile as the consumers hand it to the writer: its accumulator
// tile, numbered linear * q_tiles + i over (instance, Q tile) (its floats at
// tile * BLOCK_M * d_pad, its semaphores at tile * warps), and the key tile's
// turn on it (bwd_dq.h); tile -1 ends the CTA's turns.
struct DqTurn {
  int64_t tile;
  int target;
};

// Adds the staged tile of `stage` to its accumulator tile in its turn (bwd_dq.h: add_dq_tile,
// on the tile's first semaphore) and frees the stage. times: the timeline's sums (nullptr: not
// stamped).
template <class Cfg>
__device__ __forceinline__ void add_staged_dq(const BwdRuntime& rt, const Stage<2>& stage, int64_t tile, int target,
                                              const float* stages, uint64_t* empty, unsigned long long* times) {
  constexpr int BM = Cfg::kBlockM, kTileFloats = Cfg::kDqTileFloats;
  add_dq_tile(rt.dq_acc + tile * BM * rt.d_pad, stages + stage.index * kTileFloats, kTileFloats * 4,
              rt.sems + tile * Cfg::kDq.warps, target, empty + stage.index, times);
}

// A writer's loop over one item (Cfg::kDqWriters: writer w takes the tiles staged in stage w,
// those of even or odd n, and walks past the others): the consumers' instances and Q tiles,
// each tile's turn formed from the visible range. (With the turns named by the consumers, as
// the segment-id copy's, the plain copy measured 0.94-0.96 of this at D = 128, N >= 4k: H100,
// kernel alone.) n: the tiles staged over the CTA's life (the stage and its phase).
template <class Cfg>
__device__ __forceinline__ void write_dq_tiles(const AttentionParams& p, const BwdRuntime& rt, int64_t kept,
                                               int64_t key_tile, const float* stages, uint64_t* full,
                                               uint64_t* empty, uint32_t& n, int writer, unsigned long long* times) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
#pragma unroll 1
  for (int64_t r = 0; r < rt.kv_reduced; ++r) {
    const GroupInstance g = group_instance<BM, BN, false>(p, rt, kept, r, key_tile, 0);
#pragma unroll 1
    for (int64_t i = g.first; i <= g.last; ++i, ++n) {
      const Stage<2> stage(n);
      if (stage.index != writer) continue;
      mbar_wait(full + stage.index, stage.parity);
      add_staged_dq<Cfg>(rt, stage, g.linear * rt.q_tiles + i,
                         key_tile_turn<BM, BN>(p, rt, g.b, g.linear, i, key_tile, false, 0), stages, empty, times);
    }
  }
}

// The segment-id copy's writer w over the CTA's life: the tiles of stage w, each named with its
// turn by the consumers (DqTurn), who skip Q tiles by segment ids, so that the writer adds exactly
// the tiles they computed without a walk of its own to agree with theirs; no items, so no item
// boundaries: the consumers end with a mark in each stage. times: as add_staged_dq's, over the
// CTA's life.
template <class Cfg>
__device__ __forceinline__ void write_named_dq_tiles(const BwdRuntime& rt, const float* stages, const DqTurn* turns,
                                                     uint64_t* full, uint64_t* empty, int writer,
                                                     unsigned long long* times) {
  static_assert(Cfg::kDqWriters == 2, "a writer per dQ stage");
#pragma unroll 1
  for (uint32_t n = writer;; n += 2) {
    const Stage<2> stage(n);
    mbar_wait(full + stage.index, stage.parity);
    const DqTurn turn = turns[stage.index];
    if (turn.tile < 0) return;  // the end mark (the consumers hand over nothing after it)
    add_staged_dq<Cfg>(rt, stage, turn.tile, turn.target, stages, empty, times);
  }
}

// dK (x scale) or dV (x dv_scale) of a warp's 16 key rows, from its accumulator straight to
// global memory (`dst`: the tile's first row; rows from `rows` on and columns from `cols` on,
// the head dim where the kernel's D pads it, are not written), 16 bytes per lane and store
// after a quad_transpose of four fragments. With `vec` false (rows not 16-byte aligned, or
// `cols` not a multiple of 8) each element goes alone. No shared memory and no barrier: the
// producer may load the next item's K / V meanwhile.
template <class T, int D>
__device__ __forceinline__ void store_key_rows(const Acc<D>& acc, float scale, T* dst, int64_t row_stride,
                                               int warp_row0, int64_t rows, int cols, bool vec, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // the lane's rows warp_row0 + lane / 4 (+ 8)
    const int row = warp_row0 + frag_row(0, 2 * h, lane);
    T* const dst_row = dst + row * row_stride;
    if (!vec) {
      if (row < rows)
#pragma unroll
        for (int nf = 0; nf < D / 8; ++nf)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (frag_col(nf, e, lane) < cols)
              dst_row[frag_col(nf, e, lane)] = static_cast<T>(acc[0][nf][2 * h + e] * scale);
      continue;
    }
#pragma unroll
    for (int g = 0; g < D / 32; ++g) {  // fragments 4 g .. 4 g + 3: columns 32 g .. 32 g + 31
      uint32_t x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        x[j] = pack2(acc[0][4 * g + j][2 * h] * scale, acc[0][4 * g + j][2 * h + 1] * scale, T{});
      const uint4 words = quad_transpose(x, lane);  // (every lane shuffles, whatever it stores)
      const int col0 = 8 * (4 * g + lane % 4);  // the lane's 8 columns, all or none below cols
      if (row < rows && col0 < cols) *reinterpret_cast<uint4*>(dst_row + col0) = words;
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    backward_sm90_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ BwdRuntime rt) {
#if JF_WGMMA && JF_BWD_DQ_BULK
  using T = typename Cfg::T;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, D = Cfg::kHeadDim, kThreads = Cfg::kConsumerThreads;
  constexpr int kSubM = Cfg::kSubM;
  constexpr bool kMods = Cfg::kScoreMods, kIds = Cfg::kSegmentIds;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  using DsTile = typename Cfg::DsTile;
  extern __shared__ char smem_raw[];
  char* const smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);  // the swizzle atoms' alignment
  const KTile sK{smem + Cfg::kKOff}, sV{smem + Cfg::kVOff};
  const DsTile sdS0{smem + Cfg::kDsOff};  // the first dS^T buffer
  const QTileStages<Cfg> stages{smem};
  float* const dq_stages = reinterpret_cast<float*>(smem + Cfg::kDqStageOff);
  uint64_t* const dq_full = reinterpret_cast<uint64_t*>(smem + Cfg::kDqBarsOff);
  uint64_t* const dq_empty = dq_full + 2;
  DqTurn* const dq_turns = reinterpret_cast<DqTurn*>(smem + Cfg::kDqTurnsOff);

  // The warpgroup, as a value ptxas knows to be warp-uniform (fwd_sm90_kernel.h).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(dq_full + s, kThreads / 32);  // one arrival per consumer warp
      mbar_init(dq_empty + s, 1);             // the writer's
    }
    stages.init_barriers();
    mbar_init_fence();
  }
  __syncthreads();  // the only CTA-wide barrier: the third warpgroup leaves early
  if (warpgroup == 0) {  // warp 0 the producer, the first threads of warps 1 (and 2) the dQ writers
    regs_release<Cfg::kWriterRegs>();
    // The warp as a shuffled, warp-uniform value: on threadIdx.x < 32 ptxas kept the two
    // roles' values live across both paths, as if a warp could take both, and spilled ~400
    // bytes of the 24 registers.
    const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 32, 0);
    if (warp == 0) {
      produce<Cfg>(p, rt, stages, threadIdx.x);
    } else if (threadIdx.x % 32 == 0 && warp <= Cfg::kDqWriters) {
      const int writer = warp - 1;
      unsigned long long times[3] = {};  // this writer's sums (none outside the timeline build)
      auto stamp = [&] {  // every writer adds its sums; the last one's end is kept
        JF_TIMELINE_MAX_NOW(rt, kTlWriterDone);
        JF_TIMELINE_ADD(rt, kTlWriterSpin, times[0]);
        JF_TIMELINE_ADD(rt, kTlWriterAdd, times[1]);
        JF_TIMELINE_ADD(rt, kTlWriterTiles, times[2]);
      };
      if constexpr (kIds) {  // (the timeline's sums: over the CTA's life)
        write_named_dq_tiles<Cfg>(rt, dq_stages, dq_turns, dq_full, dq_empty, writer, kTlEnabled ? times : nullptr);
        stamp();
      } else {
        uint32_t n = 0;  // dQ tiles staged over the CTA's life
#pragma unroll 1
        for (uint32_t item = 0;; ++item) {
          const KeyTileTicket t = stages.receive_item(item);
          if (t.kept < 0) break;
          write_dq_tiles<Cfg>(p, rt, t.kept, t.key_tile, dq_stages, dq_full, dq_empty, n, writer,
                              kTlEnabled && item == kTlItem ? times : nullptr);
          if (item == kTlItem) stamp();
        }
      }
    }
    return;
  }
  regs_acquire<Cfg::kConsumerRegs>();

  const int tid = threadIdx.x - 128, lane = tid % 32, warp = tid / 32;  // among the consumers
  const int group = warp / 4, key0 = group * Cfg::kGroupKeys;
  const int warp_key0 = key0 + 16 * (warp % 4);  // the warp's accumulator rows
  // The warpgroup's 64 x 64 block of dQ, and the warp's 16 x 64 block of it
  // (its index in the dQ grid: bwd_sm90_dq_grid).
  const int dq_row0 = Cfg::kDqSplitRows ? 64 * group : 0, dq_col0 = Cfg::kDqSplitRows ? 0 : 64 * group;
  const int dq_warp = (dq_row0 / 16 + warp % 4) * Cfg::kDq.warps_n + dq_col0 / 64;
  constexpr int kDqWarpFloats = 16 * 64;
  // dS^T's stores: the lane's rows warp_key0 + lane / 4 (+ 8), columns 2 (lane % 4) (+ 8 k),
  // one origin and an XOR per store (GmmaTile::origin_at). The sixteen addresses formed
  // from scratch were hoisted out of the Q-tile loop as 16 registers, half of them spilled
  // and reloaded for every tile (D = 128) once the loads left the consumers.
  // (Buffer n's at + n DsTile::kBytes: a multiple of 1024 keeps the swizzle's phase.)
  const uint32_t ds_origin0 = sdS0.origin(warp_key0 + lane / 4, 2 * (lane % 4));

  // The soft-cap (kScoreMods): tanh's argument is S^T score_mul / softcap2.
  const bool capped = kMods && rt.softcap2 > 0.f;
  const float cap_in = capped ? rt.score_mul / rt.softcap2 : 0.f;

  // Counts over the CTA's life, which name the stages and their phases: Q tiles visited,
  // tiles handed to the writer, K / V loads.
  uint32_t q_tile_n = 0, dq_turn = 0, kv_loads = 0;
  // Hands the next dQ stage to its writer (kSegmentIds: with `turn`), once the writer's
  // reduction of two turns ago has read it; `stage_frags(dst)` first writes the tile's
  // partial into it.
  auto hand_over = [&](const DqTurn& turn, auto&& stage_frags) {
    const Stage<2> stage(dq_turn++);
    mbar_wait(dq_empty + stage.index, stage.parity ^ 1u);
    stage_frags(dq_stages + stage.index * Cfg::kDqTileFloats);
    if constexpr (kIds)
      if (tid == 0) dq_turns[stage.index] = turn;
    fence_proxy_async_shared();  // the stage writes, before the bulk engine reads them
    __syncwarp();
    mbar_arrive_if(dq_full + stage.index, lane == 0);
  };

#pragma unroll 1
  for (uint32_t item = 0;; ++item) {
    const KeyTileTicket item_tile = stages.receive_item(item);
    if (item_tile.kept < 0) break;
    if (item == kTlItem && tid == 0) JF_TIMELINE_NOW(rt, kTlStart);
    const int64_t kept = item_tile.kept, key_tile = item_tile.key_tile;
    const int64_t n0 = key_tile * BN;

    Acc<D> dk, dv;
    zero_frags(dk);
    zero_frags(dv);
    bool holds_kv = false;  // whether this item's K / V are in shared memory (a load not released)

#pragma unroll 1
    for (int64_t r = 0; r < rt.kv_reduced; ++r) {
      const GroupInstance g = group_instance<BM, BN, kIds>(p, rt, kept, r, key_tile, lane);
      const int64_t linear = g.linear, i_last = g.last, i_begin = g.first;
      const InstanceBounds& b = g.b;
      if (i_begin > i_last) continue;  // no Q tile to visit (ids that cannot meet): no dQ turn either
      const InstanceIndex inst(p, linear);
      const float alibi2 = kMods ? kLog2e * alibi_slope(p, linear) : 0.f;
      // Dropout: the pair (cuda/dropout.h) of the lane's keys s and s + 8 (warp_key0 is a
      // multiple of 16, and so is the block's column offset), as its term after the hash's
      // first step; the rows' keys come with the tile, their first step taken (dropout_mix_first
      // is linear over xor).
      const uint32_t key_first =
          Cfg::kDropout ? dropout_mix_first(dropout_pair_term(make_dropout_key(p, inst.origin<const uint32_t>(p, p.seed))
                                                                  .pair(n0 + warp_key0 + frag_row(0, 0, lane))))
                        : 0u;
      // Segment ids (kSegmentIds): the queries' come with the tile (row words), the lane's
      // two key rows' are loaded here (keys past S are masked by position).
      const bool ids = kIds && rt.segments.q != nullptr;
      int32_t key_ids[2] = {};
      if (ids) {
        const int32_t* kv_ids = inst.origin<const int32_t>(p, p.kv_segment_ids);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t key = n0 + warp_key0 + frag_row(0, 2 * h, lane);
          if (key < p.seqlen_k) key_ids[h] = __ldg(kv_ids + key * p.kv_segment_ids.row_stride);
        }
      }

      // The item's K / V, before its first visited instance (and each one's with
      // kv_per_instance: the producer's load_item loads alike): release those held (each
      // thread's products that read them are complete: it waited for them before its last
      // tile's release), wait for the new ones, and zero the rows a sequence length hides
      // (visible to the tensor cores after the first tile's fence and barrier).
      bool kv_zeroed = false;  // rows of K / V zeroed, which the next tile's products read
      if (!holds_kv || rt.kv_per_instance) {
        if (holds_kv) mbar_arrive(stages.kv_empty());
        if (item == kTlItem && tid == 0) JF_TIMELINE_NOW(rt, kTlKvIssue);
        mbar_wait(stages.kv_full(), kv_loads & 1u);
        ++kv_loads;
        holds_kv = true;
        if (item == kTlItem && tid == 0) JF_TIMELINE_NOW(rt, kTlKvLoaded);
        const int64_t rows_end = min(p.seqlen_k - n0, int64_t{BN}), kv_rows = b.kv_len - n0;
        if (kv_rows < rows_end) {
          zero_rows(sK, static_cast<int>(kv_rows), static_cast<int>(rows_end), tid, kThreads);
          zero_rows(sV, static_cast<int>(kv_rows), static_cast<int>(rows_end), tid, kThreads);
          kv_zeroed = true;
        }
      }

#pragma unroll 1
      for (int64_t i = i_begin, i_next; i <= i_last; i = i_next, ++q_tile_n) {
        const int64_t m0 = i * BM;
        const Stage<2> stage(q_tile_n);
        mbar_wait(stages.full(stage.index), stage.parity);
        // kSegmentIds: the producer's plan of the tile (the id test, the turn, the next tile),
        // each field read where it is used, not held in registers (held, they spilled in this loop).
        auto plan = [&] { return stages.plan(stage.index); };
        if (item == kTlItem && tid == 0 && i == i_begin) JF_TIMELINE_NOW(rt, kTlFirstQ);
        const QTile sQ = stages.q(stage.index), sdO = stages.d_o(stage.index);
        // Rows [q_len, T) of the tile hold the tensor's padding, which may be anything,
        // NaN included: zeros, as the cp.async copies' zero fill gave (rows past T the
        // TMA zero-filled).
        // (The same for all the consumers, as the barrier below needs.)
        const bool q_zeroed = m0 + BM > b.q_len && b.q_len < p.seqlen_q;
        if (q_zeroed) {
          const int row0 = static_cast<int>(b.q_len - m0), row_end = static_cast<int>(min(p.seqlen_q - m0, int64_t{BM}));
          zero_rows(sQ, row0, row_end, tid, kThreads);
          zero_rows(sdO, row0, row_end, tid, kThreads);
        }
        // This tile's dS^T buffer: with one, the previous tile's dQ products (every
        // warpgroup's, each waited for its own) must be complete before it is overwritten;
        // with two, they were before the previous tile's dS^T barrier, where each warpgroup
        // arrived after its dQ of the tile before (which read this buffer).
        const int ds_stage = static_cast<int>(q_tile_n % Cfg::kDsStages);
        const DsTile sdS{sdS0.ptr + ds_stage * DsTile::kBytes};
        const uint32_t ds_origin = ds_origin0 + ds_stage * DsTile::kBytes;
        if (Cfg::kDsStages == 1 || q_zeroed || kv_zeroed) {
          fence_proxy_async_shared();  // the zeros, before the tensor cores read them
          named_sync(Cfg::kConsumerBarrier, kThreads);
          kv_zeroed = false;
        }
        const float* lse2 = stages.lse2(stage.index);
        const float* delta = stages.delta(stage.index);
        const uint32_t* tile_row_words = stages.row_words(stage.index);

        const bool full = tile_pair_full<BM, BN>(p, b, m0, n0);
        const bool id_test = ids && plan()->id_test;
        // The last sub-tile's dS^T as an A operand: its dK product waits for dQ's (below).
        uint32_t dsa[kSubM / 16][4];
        // The tile's queries in sub-tiles of 64 (registers: see bwd_tile_size.h).
  #pragma unroll
        for (int sub = 0; sub < BM / kSubM; ++sub) {
          const int q0 = sub * kSubM;
          Acc<kSubM> s, dp;
          {
            const GmmaOperand<KTile, false> k_op(sK, key0), v_op(sV, key0);
            const GmmaOperand<QTile, false> q_op(sQ, q0), do_op(sdO, q0);
            wgmma_fence();
  #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) wgmma_ss<T, kSubM, false, false>(s, k_op.step(kk), q_op.step(kk), kk > 0);
            wgmma_commit();
  #pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) wgmma_ss<T, kSubM, false, false>(dp, v_op.step(kk), do_op.step(kk), kk > 0);
            wgmma_commit();
          }

          // P^T while dP^T computes. The columns are queries: each lane's two
          // adjacent columns share one 8-byte load of the row statistics.
          wgmma_wait<1>();
          hold_acc(s);
          // Each fragment's scores x to exponents: exponents(x, nf, l), l the lse2 of its two columns.
          auto to_exponents = [&](auto&& exponents) {
  #pragma unroll
            for (int nf = 0; nf < kSubM / 8; ++nf)
              exponents(s[0][nf], nf, *reinterpret_cast<const float2*>(lse2 + q0 + frag_col(nf, 0, lane)));
          };
          // The soft-cap's slope of each score, for dS^T (none without), as fp16 pairs (e = 2 h,
          // 2 h + 1): half the registers, and a slope in [0, 1] to 2^-11, below tanh.approx's error.
          uint32_t slope[kSubM / 8][2];
          if (capped)
            to_exponents([&](float (&x)[4], int nf, float2 l) {
              float t[4];
  #pragma unroll
              for (int e = 0; e < 4; ++e) {
                t[e] = soft_cap_tanh<T>(x[e] * cap_in);
                x[e] = fmaf(t[e], rt.softcap2, -(e & 1 ? l.y : l.x));
              }
  #pragma unroll
              for (int h = 0; h < 2; ++h)  // as jax's tanh JVP
                slope[nf][h] =
                    pack2((1.f - t[2 * h]) * (1.f + t[2 * h]), (1.f - t[2 * h + 1]) * (1.f + t[2 * h + 1]), __half{});
            });
          else
            to_exponents([&](float (&x)[4], int, float2 l) {
  #pragma unroll
              for (int e = 0; e < 4; ++e) x[e] = fmaf(x[e], rt.score_mul, -(e & 1 ? l.y : l.x));
            });
          if constexpr (kMods || kIds) {
            const ScoreBlock blk(p, b, m0 + q0, n0 + warp_key0);  // (queries, keys): the accumulator transposed
            if (kMods && alibi2 != 0.f) alibi_scores(s, -blk.diag, 1.f, alibi2, lane);  // hence -diag
            if (!full) mask_positions_transposed(s, blk, lane);
            if (id_test)
              apply_segment_ids_transposed(s, key_ids, reinterpret_cast<const int32_t*>(tile_row_words) + q0, lane);
          } else if (!full) {  // the ScoreBlock inside: outside, it cost this copy 40-48 B more spills
            mask_positions_transposed(s, ScoreBlock(p, b, m0 + q0, n0 + warp_key0), lane);
          }
  #pragma unroll
          for (int nf = 0; nf < kSubM / 8; ++nf)
  #pragma unroll
            for (int e = 0; e < 4; ++e) s[0][nf][e] = fast_exp2(s[0][nf][e]);  // exp2(-inf) = 0

          // dS^T. P = 0 (masked, or a row without gradient) gives dS = 0
          // exactly: an inf in V cannot leak in as 0 * inf = NaN.
          wgmma_wait<0>();
          hold_acc(dp);
          // With dropout, element e of fragment nf is key row 8 (e / 2), query column
          // e % 2: a lane's keys s and s + 8 are a pair of cuda/dropout.h (warp_key0 is
          // a multiple of 16, and so is the block's column offset), one hash per query column.
  #pragma unroll
          for (int nf = 0; nf < kSubM / 8; ++nf) {
            const int col = q0 + frag_col(nf, 0, lane);
            const float2 dl = *reinterpret_cast<const float2*>(delta + col);
            uint32_t bits[2] = {};
            if constexpr (Cfg::kDropout) {
              const uint2 row_first = *reinterpret_cast<const uint2*>(tile_row_words + col);
              bits[0] = dropout_mix_rest(row_first.x ^ key_first);
              bits[1] = dropout_mix_rest(row_first.y ^ key_first);
            }
  #pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float pv = s[0][nf][e];
              float dpv = dp[0][nf][e];
              if constexpr (Cfg::kDropout) {
                const bool keep = e < 2 ? dropout_keep_lower(bits[e & 1], p.keep_threshold)
                                        : dropout_keep_upper(bits[e & 1], p.keep_threshold);
                dpv *= keep ? p.keep_scale : 0.f;  // products with 0: NaN stays NaN (primitives/dropout.h)
                if (!keep) s[0][nf][e] *= 0.f;  // (a predicated product: one instruction, not two)
              }
              dp[0][nf][e] = pv != 0.f ? pv * (dpv - (e & 1 ? dl.y : dl.x)) : 0.f;
            }
          }
          if (capped)  // dS of the logits -> dS of K Q^T
  #pragma unroll
            for (int nf = 0; nf < kSubM / 8; ++nf)
  #pragma unroll
              for (int h = 0; h < 2; ++h) {
                const float2 sl = __half22float2(*reinterpret_cast<const __half2*>(&slope[nf][h]));
                dp[0][nf][2 * h] *= sl.x;
                dp[0][nf][2 * h + 1] *= sl.y;
              }

          // Both as T: the A operands of dV += P^T dO and dK += dS^T Q, and
          // dS^T to shared memory for dQ (register t of an A operand holds rows
          // g (+8 for odd t), columns 2 (lane % 4) (+8 for t >= 2)).
          uint32_t pa[kSubM / 16][4];
  #pragma unroll
          for (int j = 0; j < kSubM / 16; ++j) {
            a_operand<T>(pa[j], s, j);
            a_operand<T>(dsa[j], dp, j);
  #pragma unroll
            for (int t = 0; t < 4; ++t)
              sts_u32(DsTile::origin_at(ds_origin, 8 * (t & 1), q0 + 16 * j + 8 * (t >> 1)), dsa[j][t]);
          }
          const GmmaOperand<QTile, true> do_op(sdO, 0), q_op(sQ, 0);
          wgmma_fence();
  #pragma unroll
          for (int j = 0; j < kSubM / 16; ++j) wgmma_rs<T, D, true>(dv, pa[j], do_op.step(q0 / 16 + j), true);
          if (sub + 1 < BM / kSubM)  // (the last sub-tile's dK goes after dQ, below)
  #pragma unroll
            for (int j = 0; j < kSubM / 16; ++j) wgmma_rs<T, D, true>(dk, dsa[j], q_op.step(q0 / 16 + j), true);
          wgmma_commit();
        }
        fence_proxy_async_shared();  // the dS^T stores, before the tensor cores read them
        named_sync(Cfg::kConsumerBarrier, kThreads);

        Acc<64> dq;
        {
          const GmmaOperand<DsTile, true> ds_op(sdS, dq_row0);
          const GmmaOperand<KTile, true> k_op(sK, dq_col0);
          wgmma_fence();
  #pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) wgmma_ss<T, 64, true, true>(dq, ds_op.step(kk), k_op.step(kk), kk > 0);
          wgmma_commit();
          // The last sub-tile's dK behind it: dQ is handed over while dK computes.
          constexpr int q_last = BM - kSubM;
          const GmmaOperand<QTile, true> q_op(sQ, 0);
  #pragma unroll
          for (int j = 0; j < kSubM / 16; ++j) wgmma_rs<T, D, true>(dk, dsa[j], q_op.step(q_last / 16 + j), true);
          wgmma_commit();
        }
        // kSegmentIds: the key tile's turn on this Q tile (bwd_dq.h), counting only the key
        // tiles that visit it (bwd_kernel.h; the plan's); the other copies' writer forms it.
        const DqTurn turn = kIds ? DqTurn{linear * rt.q_tiles + i, plan()->turn} : DqTurn{};
        wgmma_wait<1>();  // dQ (and dV): the last dK may still run
        hold_acc(dq);
        // To the writer: each warp's block in the accumulator's layout.
        hand_over(turn, [&](float* stage_floats) {
          stage_dq_frags(dq, stage_floats + dq_warp * kDqWarpFloats, lane);
        });
        wgmma_wait<0>();  // dK: the stage's operands are free
        i_next = kIds ? plan()->next : i + 1;
        mbar_arrive(stages.empty(stage.index));  // this thread's last reads of the stage
      }
    }
    // K / V are free for the next item's load while dK / dV go out from registers.
    if (holds_kv) mbar_arrive(stages.kv_empty());
    hold_acc(dk);
    hold_acc(dv);
    if (item == kTlItem && tid == 0) JF_TIMELINE_NOW(rt, kTlLoopDone);
    const InstanceIndex out(p, compose_instance(p, rt.kv_reduce_mask, kept, 0));  // dk/dv: stride 0 on the group
    const int64_t rows_out = min(p.seqlen_k - n0, int64_t{BN});
    const int head_dim = static_cast<int>(p.head_dim);  // at most D: bwd_padded_head_dim
    const bool whole_chunks = head_dim % 8 == 0;
    store_key_rows<T, D>(dk, rt.scale, out.origin<T>(p, p.dk) + n0 * p.dk.row_stride, p.dk.row_stride, warp_key0,
                         rows_out, head_dim, rt.dk_vec && whole_chunks, lane);
    store_key_rows<T, D>(dv, rt.dv_scale, out.origin<T>(p, p.dv) + n0 * p.dv.row_stride, p.dv.row_stride,
                         warp_key0, rows_out, head_dim, rt.dv_vec && whole_chunks, lane);
    if (item == kTlItem && tid == 0) JF_TIMELINE_NOW(rt, kTlEpiStored);
  }
  if constexpr (kIds) {  // the end marks of the named turns, one to each writer's stage
    static_assert(Cfg::kDqWriters == 2, "a writer per dQ stage");
    hand_over(DqTurn{-1, 0}, [](float*) {});
    hand_over(DqTurn{-1, 0}, [](float*) {});
  }
#else
  (void)p, (void)rt;
#endif
}

}  // namespace jaxflash::gpu
