// The main backward kernel (FlashAttention-2 algebra): one CTA per (K/V tile,
// kept instance). It keeps its BLOCK_N keys' dK and dV in registers, loops
// over the instances that share them (a GQA group: the axes where dk / dv have
// stride 0), and for each over the visible Q tiles:
//
//   S, dP -> P, dS (registers, then shared memory as T)
//   dV += P^T dO,  dK += dS^T Q
//   dQ(tile) += dS K   into the fp32 workspace
//   dscale += Σ dS o (S - E)  (a traced scale's gradient, general variant: from float32 dS and
//                        a second S = Q K^T, centred on the rows' dscale_centre E; one sum per
//                        CTA, bwd_key_tile.h's store_dscale)
//   dalibi[s] -= Σ_t dS o (|d| - C)  (ALiBi's slope gradient, general variant: per key row of
//                        each query head, from float32 dS of the logits, centred on the rows'
//                        dalibi_centre C; stored after the instance's Q tiles, bwd_dalibi.h)
//
// dQ goes into the fp32 workspace in a fixed order, so the result is bitwise
// reproducible: bwd_dq.h has the protocol (shared with bwd_sm90_kernel.h).
//
// Segment ids (the general variant's copy for them, Cfg::kSegmentIds): a Q tile
// whose id range cannot meet the key
// tile's (rt.segments, segment_tiles.h) is skipped whole, loads included. It
// takes no dQ turn, so the turns count only the key tiles that meet the Q tile:
// key tile j's turn on Q tile i is the number of tiles in [j_first, j) whose
// ranges meet i's (both sides read the same table, so they agree on who
// contributes). bwd_dq.h's argument holds as it is: a warp still waits only for
// smaller key tiles of its kept instance, each of which adds to the Q tile once.
#pragma once

#include <cstdint>

#include "bwd_dalibi.h"
#include "bwd_dq.h"
#include "bwd_key_tile.h"
#include "bwd_kernel_traits.h"
#include "bwd_scores.h"
#include "instance.h"
#include "primitives/warp_gemm.h"
#include "primitives/smem_tile.h"
#include "../params.h"

namespace jaxflash::gpu {

// dQ(tile) += dS K for the CTA's turn on (instance, Q tile), in the
// accumulator block `acc` (the tile's first chunk): each warp computes its
// block of each column chunk and adds it in its turn (bwd_dq.h).
template <class Cfg>
__device__ __forceinline__ void accumulate_dq(float* acc, int* sems, int target, int*& pending,
                                              const typename Cfg::PTile& sdS, const typename Cfg::KTile& sK,
                                              float* stage, int lane, int warp) {
  using T = typename Cfg::T;
  constexpr int MF = Cfg::kQMF, NF = Cfg::kQNF;
  constexpr int kChunkFloats = Cfg::kBlockM * Cfg::kQChunkCols;
  constexpr int kWarpFloats = MF * NF * 4 * 32;  // one warp's block of a chunk
  const int row0 = (warp / Cfg::kQWarpsN) * Cfg::kQRows;
  const int col0 = (warp % Cfg::kQWarpsN) * Cfg::kQCols;
#pragma unroll 1
  for (int c = 0; c < Cfg::kQChunks; ++c) {
    float dq[MF][NF][4];
    zero_frags(dq);
    warp_gemm<T, Cfg::kF32Mma, AOrder::kMK, BOrder::kKN, Cfg::kBlockN>(dq, sdS, row0, sK, c * Cfg::kQChunkCols + col0, lane);
    add_dq_chunk(dq, acc + warp * kWarpFloats + c * kChunkFloats, c, sems + warp, target, pending,
                 stage + warp * kWarpFloats, lane);
  }
  pending = sems + warp;
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    backward_kernel(const __grid_constant__ AttentionParams p, const BwdRuntime launch_rt) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  using PTile = typename Cfg::PTile;
  constexpr int kStages = Cfg::kQStages;
  extern __shared__ __align__(128) char smem[];
  // Q and dO of stage s at smem + 2 s QTile::kBytes (+ QTile::kBytes for dO).
  char* const q_stages = smem;
  char* const kv = smem + 2 * kStages * QTile::kBytes;
  const KTile sK{kv}, sV{kv + KTile::kBytes};
  const PTile sP{kv + 2 * KTile::kBytes};
  const PTile sdS{kv + 2 * KTile::kBytes + PTile::kBytes};
  float* dq_stage = reinterpret_cast<float*>(smem + Cfg::kSmemBytes);  // sm_90 only (see the launcher)

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const KeyTileTicket ticket = take_key_tile(launch_rt, tid);
  // Not a structured binding: visit_from below captures key_tile, which C++17 lambdas cannot.
  const int64_t kept = ticket.kept, key_tile = ticket.key_tile;
  // A scale operand runs the general variant only (backward.cu): the fast one keeps its registers.
  const BwdRuntime rt = Cfg::kGeneral
                            ? with_scale_operand(p, launch_rt, compose_instance(p, launch_rt.kv_reduce_mask, kept, 0))
                            : launch_rt;
  const int64_t n0 = key_tile * BN;

  const int s_row0 = (warp / Cfg::kSWarpsN) * Cfg::kSRows, s_col0 = (warp % Cfg::kSWarpsN) * Cfg::kSCols;
  const int kv_row0 = (warp / Cfg::kKVWarpsN) * Cfg::kKVRows, kv_col0 = (warp % Cfg::kKVWarpsN) * Cfg::kKVCols;
  const int head_dim = static_cast<int>(p.head_dim);
  const bool q_vec = !Cfg::kGeneral || rt.q_vec, k_vec = !Cfg::kGeneral || rt.k_vec;
  const bool v_vec = !Cfg::kGeneral || rt.v_vec, do_vec = !Cfg::kGeneral || rt.do_vec;

  float dk[Cfg::kKVMF][Cfg::kKVNF][4], dv[Cfg::kKVMF][Cfg::kKVNF][4];
  zero_frags(dk);
  zero_frags(dv);
  // A scale operand runs the general variant only (backward.cu), so only it forms dscale.
  const bool want_dscale = Cfg::kGeneral && p.has(kHasDscale);
  float dscale = 0.f;  // this thread's share of the CTA's (bwd_scores.h, dscale_share)
  // ALiBi's slope gradient (bwd_dalibi.h): in the general copies that run ALiBi (not the one for
  // segment ids alone, bwd_scores.h), a run-time test, so calls without it pay a predicate per
  // tile pair; its sums live in shared memory, not in registers held across the Q-tile loop.
  constexpr bool kAlibiCopy = Cfg::kGeneral && (!Cfg::kSegmentIds || Cfg::kSoftcap);
  const bool want_dalibi = kAlibiCopy && p.has(kHasDalibi);
  if constexpr (kAlibiCopy)
    if (want_dalibi) clear_dalibi<Cfg>(tid);

  ResidentKv<T> resident;  // a GQA group shares the K/V rows
  int* pending = nullptr;  // semaphore of the last dQ turn, not yet signalled

#pragma unroll 1
  for (int64_t r = 0; r < rt.kv_reduced; ++r) {
    const int64_t linear = compose_instance(p, rt.kv_reduce_mask, kept, r);
    const InstanceBounds b = instance_bounds(p, linear);
    const KeyRange rows = visible_queries(p, b, n0, n0 + BN);
    if (rows.lo >= rows.hi) {  // nothing to add, and no dQ tile waits for us
      if constexpr (kAlibiCopy)
        if (want_dalibi) zero_dalibi<BN>(p, linear, n0, tid);
      continue;
    }
    const InstanceIndex inst(p, linear);
    const T* q = inst.origin<const T>(p, p.q);
    const T* d_o = inst.origin<const T>(p, p.d_o);
    ScoreInputs in{nullptr, nullptr, rt.lse2 + linear * rt.t_pad, rt.lse2_lo + linear * rt.t_pad,
                   rt.delta + linear * rt.t_pad, nullptr};
    if constexpr (Cfg::kGeneral) {
      if (p.has(kHasBias))
        in.bias = rt.bias_f32 ? static_cast<const void*>(inst.origin<const float>(p, p.bias))
                              : static_cast<const void*>(inst.origin<const T>(p, p.bias));
      if (p.has(kHasMask)) in.mask = inst.origin<const uint8_t>(p, p.mask);
      if (p.has(kDropout)) in.seed = inst.origin<const uint32_t>(p, p.seed);
      in.alibi2 = 1.4426950408889634f * alibi_slope(p, linear);
    }
    constexpr bool ids = Cfg::kSegmentIds;
    if (ids) {
      in.q_ids = inst.origin<const int32_t>(p, p.q_segment_ids);
      in.kv_ids = inst.origin<const int32_t>(p, p.kv_segment_ids);
    }
    const int64_t i_last = (rows.hi - 1) / BM;
    auto visit_from = [&](int64_t i) {  // the first Q tile from i on to visit; > i_last when none
      return ids ? rt.segments.next_meeting_q_tile(linear, i, i_last, key_tile, lane) : i;
    };
    const int64_t i_begin = visit_from(rows.lo / BM);
    if (i_begin > i_last) {  // no Q tile shares an id with these keys: no dQ turn either
      if constexpr (kAlibiCopy)
        if (want_dalibi) zero_dalibi<BN>(p, linear, n0, tid);
      continue;
    }

    // Every warp is past its last reads of the previous instance's tiles (sK / sV in the dQ
    // GEMM, the Q / dO stages in the dK / dV GEMMs) before the loads below overwrite them: the
    // dQ step has no CTA barrier, so nothing else orders them.
    __syncthreads();
    resident.template load<kThreads>(sK, sV, p, inst.origin<const T>(p, p.k) + n0 * p.k.row_stride,
                                     inst.origin<const T>(p, p.v) + n0 * p.v.row_stride,
                                     static_cast<int>(min(b.kv_len - n0, int64_t{BN})), k_vec, v_vec, tid);

    auto load_q_tile = [&](int64_t m0, int s) {
      const int valid = static_cast<int>(min(b.q_len - m0, int64_t{BM}));  // rows past q_len: zeros
      const QTile q_dst{q_stages + 2 * s * QTile::kBytes}, do_dst{q_stages + (2 * s + 1) * QTile::kBytes};
      load_tile<kThreads>(q_dst, q + m0 * p.q.row_stride, p.q.row_stride, valid, head_dim, q_vec, tid);
      load_tile<kThreads>(do_dst, d_o + m0 * p.d_o.row_stride, p.d_o.row_stride, valid, head_dim, do_vec, tid);
      cp_async_commit();
    };

    int stage = 0;  // the stage holding Q tile i
    load_q_tile(i_begin * BM, stage);
#pragma unroll 1
    for (int64_t i = i_begin, i_next; i <= i_last; i = i_next, stage = kStages == 2 ? stage ^ 1 : 0) {
      const int64_t m0 = i * BM;
      i_next = visit_from(i + 1);
      cp_async_wait<0>();  // Q, dO (and K, V the first time) landed
      __syncthreads();
      // Double buffered: the next tile loads during this whole one. Its stage
      // was last read by the previous tile's dK / dV GEMMs, which every warp
      // has finished (the barrier above).
      if (kStages == 2 && i_next <= i_last) load_q_tile(i_next * BM, stage ^ 1);
      const QTile sQ{q_stages + 2 * stage * QTile::kBytes}, sdO{q_stages + (2 * stage + 1) * QTile::kBytes};

      {
        float pr[Cfg::kSMF][Cfg::kSNF][4], ds[Cfg::kSMF][Cfg::kSNF][4];
        float logit_rows[Cfg::kSMF][2];  // the soft-cap copy's rows of dS of the logits (dscale_share)
        const bool full = tile_pair_full<BM, BN>(p, b, m0, n0);
        in.segment_test = ids && rt.segments.needs_test(linear, i, key_tile);
        // ALiBi's slope gradient from dS of the logits (bwd_dalibi.h): the instance's rows of
        // dalibi_centre, formed here from `linear` as dscale's centre is below.
        auto add_dalibi = [&](const float (&ds_logits)[Cfg::kSMF][Cfg::kSNF][4], int diag) {
          if constexpr (kAlibiCopy) {
            if (!want_dalibi) return;
            const float* centre =
                static_cast<const float*>(p.dalibi_centre.data) + instance_offset(p, p.dalibi_centre, linear);
            add_dalibi_share<Cfg>(dalibi_share(ds_logits, diag, static_cast<int>(m0 + s_row0 + b.offset), centre,
                                               p.dalibi_centre.row_stride, m0 + s_row0, p.seqlen_q, lane),
                                  warp, lane);
          }
        };
        if constexpr (Cfg::kSoftcap) {  // before the cap's slope, inside probs_and_dscores
          probs_and_dscores<Cfg>(pr, ds, p, rt, b, in, m0, n0, full, sQ, sK, sdO, sV, s_row0, s_col0, lane,
                                 want_dscale ? &logit_rows : nullptr,
                                 [&](const auto& ds_logits, const ScoreBlock& blk) { add_dalibi(ds_logits, blk.diag); });
        } else {
          probs_and_dscores<Cfg>(pr, ds, p, rt, b, in, m0, n0, full, sQ, sK, sdO, sV, s_row0, s_col0, lane);
        }
        store_frags<T>(sP, pr, s_row0, s_col0, 1.f, lane);
        // The other copies: ds is dS of the logits; P's registers are free now.
        if constexpr (!Cfg::kSoftcap)
          add_dalibi(ds, static_cast<int>(m0 + s_row0 + b.offset - n0 - s_col0));
        if (want_dscale) {
          // The instance's rows of dscale_centre, formed here from `linear` rather than held through
          // the Q-tile loop (a pointer's registers there cost the segment-id copy spills): a few
          // divisions per tile pair, in calls that differentiate a traced scale only.
          const float* centre =
              static_cast<const float*>(p.dscale_centre.data) + instance_offset(p, p.dscale_centre, linear);
          dscale += dscale_share<Cfg>(pr, ds, logit_rows, rt.softcap2 > 0.f, p, centre, m0, sQ, sK, s_row0, s_col0,
                                      lane);
        }
        store_frags<T>(sdS, ds, s_row0, s_col0, 1.f, lane);
      }
      __syncthreads();

      // dV += P^T dO, dK += dS^T Q (scale applied at the end).
      warp_gemm<T, Cfg::kF32Mma, AOrder::kKM, BOrder::kKN, BM>(dv, sP, kv_row0, sdO, kv_col0, lane);
      warp_gemm<T, Cfg::kF32Mma, AOrder::kKM, BOrder::kKN, BM>(dk, sdS, kv_row0, sQ, kv_col0, lane);
      if (kStages == 1) {
        __syncthreads();  // sQ, sdO free: fetch the next tile behind the dQ step
        if (i_next <= i_last) load_q_tile(i_next * BM, 0);
      }

      const int target = key_tile_turn<BM, BN>(p, rt, b, linear, i, key_tile, ids, lane);
      accumulate_dq<Cfg>(rt.dq_acc + (linear * rt.t_pad + m0) * rt.d_pad,
                         rt.sems + (linear * rt.q_tiles + i) * Cfg::kWarps, target, pending, sdS, sK, dq_stage,
                         lane, warp);
    }
    if constexpr (kAlibiCopy) {
      if (want_dalibi) store_dalibi<Cfg>(p, linear, n0, tid);  // the instance's key rows: this CTA's
    }
  }
  flush_dq_turn(pending, lane);
  store_dk_dv<kThreads, BN, T>(p, rt, sK, sV, dk, dv, kv_row0, kv_col0, kept, n0, tid);
  if (want_dscale) store_dscale<kThreads, BN>(p, rt, dscale, kept, n0, tid);
}

}  // namespace jaxflash::gpu
