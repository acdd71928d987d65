// The sm_90 backward kernel: the FlashAttention-2 backward of bwd_kernel.h
// (same grid, tickets, GQA loop, Q-tile range and dQ protocol) with every
// product on Hopper's warpgroup MMA (primitives/wgmma.h), for the cases of
// bwd_tile_size.h's sm_90 table (16-bit, D = 64 / 128, no bias or mask).
//
// Why a second kernel: the mma.sync backward feeds all five products from
// shared memory through ldmatrix, 8 warps per SM; it runs at 0.7-0.8 of
// FlashAttention-2 and is bound by the fragment loads' latency. wgmma reads
// shared memory itself, so the threads only do the element-wise work.
//
// A CTA owns 128 keys, warpgroup g the 64 keys [64 g, 64 g + 64) of them, and
// computes everything *transposed*, keys as rows, so that the accumulators of
// its first products are the A operands of the next ones:
//
//   S^T  = K_g Q^T,   dP^T = V_g dO^T          SS, K-major  (64 x BLOCK_M)
//   P^T  = exp2(S^T scale log2e - lse2),  dS^T = P^T o (dP^T - delta)
//          (with dropout, bwd_scores.h's algebra: P^T o Z^T, c Z^T o dP^T)
//          lse2 is the lse's hi alone: its lo (params.h) is below what 16 bits
//          resolve in P (bwd_scores.h), and where it would show (logits beyond
//          ~6e3), this kernel's S^T = K Q^T does not round as the forward's
//          S = Q K^T does, which moves P more (test_numerics' large logits:
//          fp16 on Hopper is a known failure, with lo subtracted too).
//          Subtracting lo cost 2-3.5% here.
//   dV_g += P^T dO,   dK_g += dS^T Q           RS, B MN-major (64 x D)
//   dS^T -> shared memory; barrier
//   dQ  (its 16 x 64 blocks) = dS K            SS, both MN-major
//   dQ  -> a shared-memory stage, for the writer
//
// Overlap inside a warpgroup: dP^T runs while P^T is computed, dV while dS^T
// is; the two warpgroups meet at two barriers per Q tile (the tile has
// landed; dS^T is complete). Q / dO are double buffered with cp.async, so the
// next tile loads during the whole current one.
//
// The dQ writer: a third warpgroup whose one working thread adds each staged
// dQ tile to the accumulator in the tile's turn (bwd_dq.h's protocol), so the
// consumers never wait for another CTA's turn nor pay the GPU-scope release
// of their own: on the H100 those were ~30% of the consumer warps' stall
// samples (D = 128, N = 4k) when the warps did it themselves. The stage is
// double buffered (mbarriers full / empty); the warpgroup gives its registers
// to the consumers (setmaxnreg), as the forward's producer does.
#pragma once

#include <cstdint>

#include "bwd_dq.h"
#include "bwd_key_tile.h"
#include "bwd_kernel_traits.h"
#include "bwd_scores.h"
#include "instance.h"
#include "primitives/smem_tile.h"
#include "primitives/tma.h"
#include "primitives/wgmma.h"
#include "../params.h"

namespace jaxflash::gpu {

// kDropout: a copy of the kernel with dropout, so that the copy without keeps
// its registers (the dropout's state adds ~50-100 bytes of spills).
template <class T_, int D, bool kDropout_>
struct BwdSm90Config {
  using T = T_;
  static_assert(bwd_sm90_covers(sizeof(T), D), "see bwd_tile_size.h");
  static constexpr int kHeadDim = D;
  static constexpr bool kDropout = kDropout_;
  static constexpr int kBlockM = bwd_sm90_block_m(D), kBlockN = kBwdSm90BlockN;
  static constexpr int kConsumerThreads = 256;  // two warpgroups
  static constexpr int kThreads = 128 + kConsumerThreads;  // and the dQ writer's
  static constexpr int kConsumerBarrier = 1;  // the consumers' named barrier
  // Registers per thread after setmaxnreg (primitives/tma.h's balance): the
  // writer's warpgroup keeps 24, the consumers get 240.
  static constexpr int kWriterRegs = 24;
  static constexpr int kConsumerRegs = consumer_regs(kThreads, kConsumerThreads, kWriterRegs);
  static_assert(kConsumerRegs == 240, "the registers bwd_tile_size.h counts on");
  static constexpr int kGroupKeys = kBlockN / 2;
  static constexpr int kSubM = 64;  // queries per S^T / dP^T product
  static constexpr BwdDqGrid kDq = bwd_sm90_dq_grid(D);
  // dQ's split between the warpgroups: by rows (BLOCK_M = 128) or columns.
  static constexpr bool kDqSplitRows = kBlockM == 128;
  static_assert(kDqSplitRows != (D == 128), "each warpgroup computes a 64 x 64 block of dQ");

  using QTile = GmmaTile<T, kBlockM, D>;        // Q and dO
  using KTile = GmmaTile<T, kBlockN, D>;        // K and V (then dK, dV on the way out)
  using DsTile = GmmaTile<T, kBlockN, kBlockM>;  // dS^T, [key][query]
  // Offsets from the 1024-byte aligned base: Q / dO of stage s at 2 s (2 s + 1)
  // QTile::kBytes, then K, V, dS^T, lse2 / delta of stage s at kStatsOff +
  // (2 s, 2 s + 1) BLOCK_M floats, the dropout's row keys of stage s at
  // kRowKeysOff + s BLOCK_M words, the two dQ stages, their mbarriers (full
  // 0, 1, empty 0, 1).
  static constexpr int kKOff = 4 * QTile::kBytes, kVOff = kKOff + KTile::kBytes, kDsOff = kVOff + KTile::kBytes;
  static constexpr int kStatsOff = kDsOff + DsTile::kBytes;
  static constexpr int kRowKeysOff = kStatsOff + 4 * kBlockM * 4;
  static constexpr int kDqStageOff = kRowKeysOff + 2 * kBlockM * 4;
  static constexpr int kDqTileFloats = kBlockM * D;
  static constexpr int kDqBarsOff = kDqStageOff + 2 * kDqTileFloats * 4;
  static constexpr int kSmemBytes = kDqBarsOff + 4 * 8 + 1024;
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

// The writer's loop: the consumers' instances and Q tiles in their order, each
// tile's staged dQ added in its turn (bwd_dq.h: add_dq_tile), on the tile's
// first semaphore.
template <class Cfg>
__device__ __forceinline__ void write_dq_tiles(const AttentionParams& p, const BwdRuntime& rt, int64_t kept,
                                               int64_t key_tile, const float* stages, uint64_t* full,
                                               uint64_t* empty) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, kTileFloats = Cfg::kDqTileFloats;
  const int64_t n0 = key_tile * BN;
  int* pending = nullptr;
  uint32_t turn = 0;
#pragma unroll 1
  for (int64_t r = 0; r < rt.kv_reduced; ++r) {
    const int64_t linear = compose_instance(p, rt.kv_reduce_mask, kept, r);
    const InstanceBounds b = instance_bounds(p, linear);
    const KeyRange rows = visible_queries(p, b, n0, n0 + BN);
#pragma unroll 1
    for (int64_t i = rows.lo / BM; rows.lo < rows.hi && i <= (rows.hi - 1) / BM; ++i, ++turn) {
      const int64_t m0 = i * BM;
      const Stage<2> stage(turn);
      mbar_wait(full + stage.index, stage.parity);
      const int target = static_cast<int>(key_tile - visible_keys(p, b, m0, m0 + BM).lo / BN);
      add_dq_tile(rt.dq_acc + (linear * rt.t_pad + m0) * rt.d_pad, stages + stage.index * kTileFloats,
                  kTileFloats * 4, rt.sems + (linear * rt.q_tiles + i) * Cfg::kDq.warps, target, pending,
                  empty + stage.index);
    }
  }
  flush_dq_turn(pending, 0);
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    backward_sm90_kernel(const __grid_constant__ AttentionParams p, const BwdRuntime rt) {
#if JF_WGMMA && JF_BWD_DQ_BULK
  using T = typename Cfg::T;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, D = Cfg::kHeadDim, kThreads = Cfg::kConsumerThreads;
  constexpr int kSubM = Cfg::kSubM;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  using DsTile = typename Cfg::DsTile;
  extern __shared__ char smem_raw[];
  char* const smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);  // the swizzle atoms' alignment
  const KTile sK{smem + Cfg::kKOff}, sV{smem + Cfg::kVOff};
  const DsTile sdS{smem + Cfg::kDsOff};
  float* const stats = reinterpret_cast<float*>(smem + Cfg::kStatsOff);
  uint32_t* const row_keys = reinterpret_cast<uint32_t*>(smem + Cfg::kRowKeysOff);
  float* const dq_stages = reinterpret_cast<float*>(smem + Cfg::kDqStageOff);
  uint64_t* const dq_full = reinterpret_cast<uint64_t*>(smem + Cfg::kDqBarsOff);
  uint64_t* const dq_empty = dq_full + 2;

  // The warpgroup, as a value ptxas knows to be warp-uniform (fwd_sm90_kernel.h).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(dq_full + s, kThreads / 32);  // one arrival per consumer warp
      mbar_init(dq_empty + s, 1);             // the writer's
    }
    mbar_init_fence();
  }
  const auto [kept, key_tile] = take_key_tile(rt, threadIdx.x);  // (its CTA barrier covers the inits)
  if (warpgroup == 0) {
    regs_release<Cfg::kWriterRegs>();
    if (threadIdx.x == 0) write_dq_tiles<Cfg>(p, rt, kept, key_tile, dq_stages, dq_full, dq_empty);
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

  const int64_t n0 = key_tile * BN;
  const int head_dim = static_cast<int>(p.head_dim);

  Acc<D> dk, dv;
  zero_frags(dk);
  zero_frags(dv);

  ResidentKv<T> resident;  // a GQA group shares the K/V rows
  uint32_t dq_turn = 0;    // Q tiles done: the dQ stage and its phase

#pragma unroll 1
  for (int64_t r = 0; r < rt.kv_reduced; ++r) {
    const int64_t linear = compose_instance(p, rt.kv_reduce_mask, kept, r);
    const InstanceBounds b = instance_bounds(p, linear);
    const KeyRange rows = visible_queries(p, b, n0, n0 + BN);
    if (rows.lo >= rows.hi) continue;
    const InstanceIndex inst(p, linear);
    const T* q = inst.origin<const T>(p, p.q);
    const T* d_o = inst.origin<const T>(p, p.d_o);
    const float* lse2_rows = rt.lse2 + linear * rt.t_pad;
    const float* delta_rows = rt.delta + linear * rt.t_pad;
    const uint32_t* seed = Cfg::kDropout ? inst.origin<const uint32_t>(p, p.seed) : nullptr;

    // Every warpgroup's products of the previous instance are complete (each
    // waited for its own before its last barrier); this one orders them
    // before the loads below overwrite their operands.
    named_sync(Cfg::kConsumerBarrier, kThreads);
    resident.template load<kThreads>(sK, sV, p, inst.origin<const T>(p, p.k) + n0 * p.k.row_stride,
                                     inst.origin<const T>(p, p.v) + n0 * p.v.row_stride,
                                     static_cast<int>(min(b.kv_len - n0, int64_t{BN})), true, true, tid);

    // Q, dO and their rows' lse2 / delta (the workspace pads them to whole
    // tiles: lse2 = +inf past q_len, so those rows' P is 0), and with dropout
    // the rows' keys: hashed once per tile here, rather than by each lane for
    // the 16 queries of each of its sub-tiles.
    auto load_q_tile = [&](int64_t m0, int s) {
      const int valid = static_cast<int>(min(b.q_len - m0, int64_t{BM}));
      load_tile<kThreads>(QTile{smem + 2 * s * QTile::kBytes}, q + m0 * p.q.row_stride, p.q.row_stride, valid,
                          head_dim, true, tid);
      load_tile<kThreads>(QTile{smem + (2 * s + 1) * QTile::kBytes}, d_o + m0 * p.d_o.row_stride, p.d_o.row_stride,
                          valid, head_dim, true, tid);
      if (tid < BM / 2) {
        const int which = tid / (BM / 4), c = tid % (BM / 4);
        cp_async_16(smem_addr(stats + (2 * s + which) * BM + 4 * c), (which ? delta_rows : lse2_rows) + m0 + 4 * c);
      }
      if (Cfg::kDropout && tid < BM)
        row_keys[s * BM + tid] = make_dropout_key(seed, p.seed.col_stride, p.keep_threshold).row_key(m0 + tid);
      cp_async_commit();
    };

    const int64_t i_first = rows.lo / BM, i_last = (rows.hi - 1) / BM;
    int stage = 0;
    load_q_tile(i_first * BM, stage);
#pragma unroll 1
    for (int64_t i = i_first; i <= i_last; ++i, stage ^= 1) {
      const int64_t m0 = i * BM;
      cp_async_wait<0>();
      fence_proxy_async_shared();  // the copies, before the tensor cores read them
      named_sync(Cfg::kConsumerBarrier, kThreads);
      // The other stage was last read by the previous tile's products, which
      // every warpgroup waited for before the barrier above.
      if (i < i_last) load_q_tile(m0 + BM, stage ^ 1);
      const QTile sQ{smem + 2 * stage * QTile::kBytes}, sdO{smem + (2 * stage + 1) * QTile::kBytes};
      const float* lse2 = stats + 2 * stage * BM;
      const float* delta = lse2 + BM;
      const uint32_t* tile_row_keys = row_keys + stage * BM;

      const bool full = tile_pair_full<BM, BN>(p, b, m0, n0);
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
#pragma unroll
        for (int nf = 0; nf < kSubM / 8; ++nf) {
          const float2 l = *reinterpret_cast<const float2*>(lse2 + q0 + frag_col(nf, 0, lane));
#pragma unroll
          for (int e = 0; e < 4; ++e) s[0][nf][e] = fmaf(s[0][nf][e], rt.score_mul, -(e & 1 ? l.y : l.x));
        }
        if (!full) mask_positions_transposed(s, ScoreBlock(p, b, m0 + q0, n0 + warp_key0), lane);
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
        // a multiple of 16), one hash per query column.
        const uint32_t key_pair = dropout_pair(n0 + warp_key0 + frag_row(0, 0, lane));
#pragma unroll
        for (int nf = 0; nf < kSubM / 8; ++nf) {
          const int col = q0 + frag_col(nf, 0, lane);
          const float2 dl = *reinterpret_cast<const float2*>(delta + col);
          uint32_t bits[2] = {};
          if constexpr (Cfg::kDropout) {
            const uint2 rk = *reinterpret_cast<const uint2*>(tile_row_keys + col);
            bits[0] = dropout_pair_bits(rk.x, key_pair);
            bits[1] = dropout_pair_bits(rk.y, key_pair);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pv = s[0][nf][e];
            float dpv = dp[0][nf][e];
            if constexpr (Cfg::kDropout) {
              const bool keep = e < 2 ? dropout_keep_lower(bits[e & 1], p.keep_threshold)
                                      : dropout_keep_upper(bits[e & 1], p.keep_threshold);
              dpv *= keep ? p.keep_scale : 0.f;  // products with 0: NaN stays NaN (primitives/dropout.h)
              s[0][nf][e] *= keep ? 1.f : 0.f;
            }
            dp[0][nf][e] = pv != 0.f ? pv * (dpv - (e & 1 ? dl.y : dl.x)) : 0.f;
          }
        }

        // Both as T: the A operands of dV += P^T dO and dK += dS^T Q, and
        // dS^T to shared memory for dQ (register t of an A operand holds rows
        // g (+8 for odd t), columns 2 (lane % 4) (+8 for t >= 2)).
        uint32_t pa[kSubM / 16][4], dsa[kSubM / 16][4];
#pragma unroll
        for (int j = 0; j < kSubM / 16; ++j) {
          a_operand<T>(pa[j], s, j);
          a_operand<T>(dsa[j], dp, j);
#pragma unroll
          for (int t = 0; t < 4; ++t)
            sdS.template at<uint32_t>(warp_key0 + lane / 4 + 8 * (t & 1), q0 + 16 * j + 8 * (t >> 1) + 2 * (lane % 4)) =
                dsa[j][t];
        }
        const GmmaOperand<QTile, true> do_op(sdO, 0), q_op(sQ, 0);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < kSubM / 16; ++j) wgmma_rs<T, D, true>(dv, pa[j], do_op.step(q0 / 16 + j), true);
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
      }
      wgmma_wait<0>();  // dQ, and this tile's dV / dK: their operands are free
      hold_acc(dq);

      // To the writer: each warp's block in the accumulator's layout, once the
      // writer's reduction of two tiles ago has read the stage.
      const Stage<2> dq_stage(dq_turn);
      mbar_wait(dq_empty + dq_stage.index, dq_stage.parity ^ 1u);
      stage_dq_frags(dq, dq_stages + dq_stage.index * Cfg::kDqTileFloats + dq_warp * kDqWarpFloats, lane);
      fence_proxy_async_shared();  // the stage writes, before the bulk engine reads them
      __syncwarp();
      mbar_arrive_if(dq_full + dq_stage.index, lane == 0);
      ++dq_turn;
    }
  }
  hold_acc(dk);
  hold_acc(dv);
  store_dk_dv<kThreads, BN, T, Cfg::kConsumerBarrier>(p, rt, sK, sV, dk, dv, warp_key0, 0, kept, n0, tid);
#else
  (void)p, (void)rt;
#endif
}

}  // namespace jaxflash::gpu
