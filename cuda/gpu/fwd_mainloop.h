// The forward main loop of one CTA: stream the visible K/V tiles through
// shared memory and fold each into the running softmax and O of the CTA's
// BLOCK_M query rows.
//
// Pipeline (one K buffer, one V buffer, each load overlapped with the other GEMM):
//
//   wait K_j           | issue V_j   | S = Q K_j^T, scores
//   wait V_j           | issue K_j-1 | softmax, O += P V_j
//
// so every copy has a whole GEMM to hide behind while shared memory stays at
// (BLOCK_M + 2 BLOCK_N) x D. The barrier before each issue also guarantees the
// buffer it overwrites is no longer read by any warp.
//
// Tiles go from the last to the first (the softmax does not care), so the one
// tile with rows past kv_len is the first: its K is loaded before the loop and
// every K loaded inside is whole, a copy with no bounds. Only tiles that need
// the position mask (kv_len, the diagonal and window edges) are "masked". With
// Cfg::kSplitSteps masked and whole tiles get separate copies of the step (the
// whole one free of mask branches); otherwise one copy branches inside.
//
// Segment ids (the general variant's copy for them, Cfg::kSegmentIds): a key
// tile whose id range cannot meet the query tile's (rt.segments,
// segment_tiles.h) is skipped whole, K prefetch included: the loop steps from
// one meeting tile to the next one down. Only the top tile can end past
// kv_len, so every tile loaded inside the loop is still whole.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fwd_scores.h"
#include "kernel_traits.h"
#include "primitives/dropout.h"
#include "primitives/mma.h"
#include "primitives/positions.h"
#include "primitives/score.h"
#include "primitives/smem_tile.h"
#include "primitives/softmax.h"
#include "../params.h"

namespace jaxflash::gpu {

// Runs over the key tiles covering [key_lo, key_hi) (non-empty) for query rows
// [m0, m0 + BLOCK_M) of instance `linear`. On return o holds the unnormalised
// output of this warp's rows and st their softmax state.
template <class Cfg>
__device__ __forceinline__ void forward_mainloop(const AttentionParams& p, const FwdRuntime& rt,
                                                 const Positions& pos, const FwdOperands<typename Cfg::T>& ops,
                                                 int64_t linear, int m0, int key_lo, int key_hi,
                                                 const typename Cfg::QTile& sQ, const typename Cfg::KTile& sK, const typename Cfg::VTile& sV,
                                                 float (&o)[Cfg::kMF][Cfg::kDF][4], typename Cfg::State& st,
                                                 int tid) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  const int lane = tid % 32;
  const int warp_row = (tid / 32) * Cfg::kWarpRows;  // first row of this warp in the tile
  // The fast variant runs only on whole head dims and aligned rows: as
  // compile-time facts they remove the bounds and the fallback from its copies.
  const int cols = Cfg::kGeneral ? static_cast<int>(p.head_dim) : Cfg::kHeadDim;
  const bool q_vec = !Cfg::kGeneral || rt.q_vec, k_vec = !Cfg::kGeneral || rt.k_vec;
  const bool v_vec = !Cfg::kGeneral || rt.v_vec;
  const int64_t k_stride = p.k.row_stride, v_stride = p.v.row_stride;
  // K/V rows past kv_len are zero-filled, not read: padding may hold anything
  // (NaN included), and 0 * NaN would leak into O through P = 0.
  auto kv_rows = [&](int n0) { return min(pos.kv_len - n0, BN); };
  // Dropout (general variant): this lane's row keys, hashed once for all key tiles.
  const DropoutKey dropout =
      Cfg::kGeneral && ops.seed != nullptr ? make_dropout_key(p, ops.seed) : DropoutKey{};
  const FragRowKeys<Cfg::kMF> dropout_rows(dropout, m0 + warp_row, lane);

  // Segment ids: whether key tile n0 may see this query tile, and whether it
  // needs the element test (both uniform over the CTA).
  constexpr bool ids = Cfg::kSegmentIds;
  const int first = key_lo / BN * BN;
  auto meets = [&](int n0) { return !ids || rt.segments.may_meet(linear, m0 / BM, n0 / BN); };
  auto next_down = [&](int n0) {  // the next key tile below n0 to visit; < first when none
    do n0 -= BN;
    while (n0 >= first && !meets(n0));
    return n0;
  };
  int last = (key_hi - 1) / BN * BN;
  if constexpr (ids) {
    if (!meets(last)) last = next_down(last);
    if (last < first) return;  // no key tile shares an id with these rows: O = 0, lse = -inf
  }

  load_tile<kThreads>(sQ, ops.q + m0 * p.q.row_stride, p.q.row_stride, min(pos.q_len - m0, BM), cols, q_vec, tid);
  load_tile<kThreads>(sK, ops.k + last * k_stride, k_stride, kv_rows(last), cols, k_vec, tid);
  cp_async_commit();

  // One key tile at n0. masked (a bool, or a std::bool_constant for a
  // specialised copy): the position mask applies, and V may end past kv_len.
  auto step = [&](int n0, auto masked_arg) {
    bool masked;  // a compile-time constant in the specialised copies
    if constexpr (std::is_same_v<decltype(masked_arg), bool>)
      masked = masked_arg;
    else
      masked = decltype(masked_arg)::value;
    cp_async_wait<0>();  // K of this tile (and Q, the first time) landed
    __syncthreads();     // ... for every thread; and every warp is done with the previous V
    load_tile<kThreads>(sV, ops.v + n0 * v_stride, v_stride, masked ? kv_rows(n0) : BN, cols, v_vec, tid);
    cp_async_commit();

    float s[Cfg::kMF][Cfg::kNF][4];
    zero_frags(s);
    warp_gemm<T, Cfg::kF32Mma, AOrder::kMK, BOrder::kNK, Cfg::kHeadDim>(s, sQ, warp_row, sK, 0, lane);
    score_tile<Cfg>(s, p, rt, pos, ops, m0 + warp_row, n0, !masked,
                    ids && rt.segments.needs_test(linear, m0 / BM, n0 / BN), lane);

    cp_async_wait<0>();  // V landed
    __syncthreads();     // ... for every thread; and every warp is done with K
    if (const int next = next_down(n0); next >= first) {  // below the top tile: whole, next + BN <= kv_len
      load_tile<kThreads>(sK, ops.k + next * k_stride, k_stride, BN, cols, k_vec, tid);
      cp_async_commit();
    }
    online_softmax(s, o, st, rt.exp_scale, rt.p_shift);
    // After the softmax's sums: dropout changes what reaches O, not the normaliser.
    if constexpr (Cfg::kGeneral)
      if (ops.seed != nullptr) drop_probabilities(s, dropout, dropout_rows, n0, lane);
    using Pv = PvOps<T, Cfg::kF32Mma>;
    typename Pv::AFrag a[Cfg::kMF][Cfg::kBlockN / Pv::kK];
    p_fragments<T, Cfg::kF32Mma>(a, s);
    gemm_pv<T, Cfg::kF32Mma>(o, a, sV, lane);
  };

  const FullTiles<BN> full(pos, m0, min(m0 + BM, pos.q_len) - 1);
  if constexpr (Cfg::kSplitSteps) {
    int n0 = last;
    for (; n0 >= first && n0 > full.hi; n0 = next_down(n0)) step(n0, std::true_type{});    // kv_len, diagonal, right edge
    for (; n0 >= first && n0 >= full.lo; n0 = next_down(n0)) step(n0, std::false_type{});  // the bulk
    for (; n0 >= first; n0 = next_down(n0)) step(n0, std::true_type{});                    // left window edge
  } else {
    for (int n0 = last; n0 >= first; n0 = next_down(n0)) step(n0, !full.contain(n0));
  }
}

}  // namespace jaxflash::gpu
