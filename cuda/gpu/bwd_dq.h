// The backward's deterministic dQ accumulation, shared by the main kernels
// (bwd_kernel.h, bwd_sm90_kernel.h): each CTA computes dQ partials of the Q
// tiles its keys see, and adds them to the fp32 accumulator in the workspace.
//
// Deterministic dQ. Every (instance, Q tile) has one semaphore per warp,
// counting the key tiles whose warp of that index has added its block of the
// tile (a warp's block is the same in every CTA). The key tiles that touch Q
// tile i are a contiguous range [j_first, j_last] (the visible band is
// convex), with j_first = visible_keys(i).lo / BLOCK_N; warp w of key tile j
// waits until its semaphore equals its turn (key_tile_turn, bwd_key_tile.h: j -
// j_first, or j_last - j where the key tiles go in descending order), adds its
// partial (sm_90: one bulk reduction from shared memory; sm_80: fp32 atomics),
// waits for the adds to complete, fences and increments. So each dQ element
// receives its adds in one fixed key-tile order, whatever the schedule:
// bitwise reproducible. The
// CTA's own Q-tile range comes from visible_queries(j), the transpose of the
// same band, so the two sides agree on exactly which key tiles contribute
// (params.h computes both from one rule).
//
// No deadlock. CTAs do not use blockIdx: each takes a ticket from a zeroed
// counter on entry and decodes (kept instance, key tile) from it
// (bwd_key_tile.h): within an instance, key tiles follow the ticket in the
// turns' order. A warp only ever waits for a warp of a CTA of the same kept
// instance whose key tile comes earlier in that order, i.e. a smaller ticket,
// and a CTA holding
// a ticket is resident (it took it while running). By induction on tickets
// the smallest unfinished one waits on nothing unfinished (its warps wait
// only for each other, at barriers), so it completes: no reliance on the
// hardware dispatching blocks in index order.
//
// The first turn on a tile (target 0) stores instead of adding, so the
// accumulator needs no clearing: a plain store (sm_90: a bulk copy) of the
// partial, in the same place of the order as an add to zero would be, and bit
// for bit the same but for the sign of a zero. Tiles that no key tile visits
// get no turn; the post-pass writes 0 for them (their first semaphore is 0).
//
// A turn's signal is deferred until just before the warp's next wait (or the
// CTA's exit), so the completion wait and fence find the adds already done
// instead of stalling on them. That keeps the argument intact: a warp never
// waits while holding an unsignalled turn, and between a turn and its signal
// it only computes and meets its own CTA's barriers.
//
// The sm_90 kernel hands the protocol to one writer thread (add_dq_tile): its
// consumer warpgroups stage the whole dQ tile in shared memory and go on, and
// the writer adds it with one bulk reduction in the tile's turn, counted on
// the tile's first semaphore alone, and signals the turn at once. The argument
// holds with the writer in the warps' place: it waits for other CTAs only in
// its spin, holding no unsignalled turn, and otherwise for its own consumers,
// who wait for nothing outside the CTA but the writer's release of a stage,
// which it gives before its next spin.
#pragma once

#include <cstdint>

#include "primitives/dq_order.h"
#include "primitives/tma.h"
#include "timeline.h"

namespace jaxflash::gpu {

// The calling thread spins until *sem >= target.
__device__ __forceinline__ void spin_until(const int* sem, int target) {
  while (ld_acquire_gpu(sem) < target) __nanosleep(32);
}

// Position of element e (0..3, the C-fragment order) of fragment (mf, nf) of
// `lane` inside its warp's block of the dQ accumulator (a chunk is
// block_m x chunk_cols floats; warp w's block starts at w * MF * NF * 128):
// fragment order, each element's 32 lanes contiguous. Every warp store /
// atomic then covers 128 contiguous bytes (conflict-free in shared memory,
// whole sectors at L2); backward_postpass un-permutes (BwdDqGrid).
template <int NF>
__device__ __forceinline__ int dq_frag_offset(int mf, int nf, int e, int lane) {
  return ((mf * NF + nf) * 4 + e) * 32 + lane;
}

// The warp's dQ partial `dq`, in fragment order, to its block of a shared-memory stage.
template <int MF, int NF>
__device__ __forceinline__ void stage_dq_frags(const float (&dq)[MF][NF][4], float* warp_stage, int lane) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) warp_stage[dq_frag_offset<NF>(mf, nf, e, lane)] = dq[mf][nf][e];
}

// Chunk c of the warp's dQ partial `dq` (its block of that chunk) += into
// `block`, its block of the chunk in the accumulator, in the warp's turn: for
// c = 0 it waits until its semaphore `sem` (which the same warp of the
// previous key tile signals) reaches `target`. Each warp adds on its own, no
// CTA barrier: a warp waiting for its turn holds up no other warp. The signal
// of the previous turn, `pending`, is given just before (the caller then sets
// pending = sem after its last chunk, flush_dq_turn signals it at exit): by
// then the adds have long landed and the signal costs no wait.
//
// sm_90: the partial goes to the warp's part of the shared-memory stage
// `warp_stage` (fragment order, so it is contiguous) and lane 0 issues one
// bulk reduction. sm_80: every lane adds with coalesced fp32 atomics.
template <int MF, int NF>
__device__ __forceinline__ void add_dq_chunk(const float (&dq)[MF][NF][4], float* block, int c, int* sem, int target,
                                             int* pending, float* warp_stage, int lane) {
#if JF_BWD_DQ_BULK
  constexpr int kWarpFloats = MF * NF * 4 * 32;
  if (lane == 0) {
    if (c == 0 && pending != nullptr) {  // signal the last turn (its reduction also freed the stage)
      bulk_wait_all();
      fence_proxy_async_global();
      red_release_gpu(pending, 1);
    } else if (c > 0) {
      bulk_wait_reads();  // the previous chunk's reduction has read the stage
    }
  }
  __syncwarp();  // the stage is free
  stage_dq_frags(dq, warp_stage, lane);
  fence_proxy_async_shared();  // the stage writes, before the bulk engine reads them
  __syncwarp();
  if (lane == 0) {
    if (c == 0) {
      spin_until(sem, target);
      fence_proxy_async_global();
    }
    if (target == 0) bulk_store_f32(block, warp_stage, kWarpFloats * 4);
    else bulk_reduce_add_f32(block, warp_stage, kWarpFloats * 4);
    bulk_commit();
  }
#else
  (void)warp_stage;
  if (c == 0) {
    if (pending != nullptr) {  // every lane's atomics done and visible, then one increment
      __threadfence();
      __syncwarp();
      if (lane == 0) atomicAdd(pending, 1);
    }
    if (lane == 0) spin_until(sem, target);
    __syncwarp();
  }
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float* const at = block + dq_frag_offset<NF>(mf, nf, e, lane);
        if (target == 0) *at = dq[mf][nf][e];
        else atomicAdd(at, dq[mf][nf][e]);
      }
#endif
}

// The warp's last pending signal, before the CTA exits (the sm_90 writer's
// signal of each turn too).
__device__ __forceinline__ void flush_dq_turn(int* pending, int lane) {
  if (pending == nullptr) return;
#if JF_BWD_DQ_BULK
  if (lane == 0) {
    bulk_wait_all();
    fence_proxy_async_global();
    red_release_gpu(pending, 1);
  }
#else
  __threadfence();
  __syncwarp();
  if (lane == 0) atomicAdd(pending, 1);
#endif
}

// The sm_90 writer's turn for one dQ tile (bwd_sm90_kernel.h), by a single
// thread: `stage` holds the CTA's partial of the whole tile (the consumers
// staged it in the accumulator's layout), `tile` is its block of the
// accumulator. Waits for the turn (semaphore `sem` reaching `target`), adds
// with one bulk reduction, releases the stage (`stage_empty`) once the
// reduction has read it, and signals the turn as soon as the add has landed.
// Unlike the warps' turns above, the signal is not deferred: the writer has
// nothing else to do while the reduction completes (its consumers got their
// stage back already), and deferring it to the next tile's turn held the next
// key tile's writer back until this CTA's consumers had staged their next tile
// (docs/DESIGN.md, the dQ writer: 1.01-1.05x on the H100).
// times: with JAXFLASH_BWD_TIMELINE, where the wait for the turn and the reduction's time to
// the release are summed (ns; nullptr: not stamped).
__device__ __forceinline__ void add_dq_tile(float* tile, const float* stage, int bytes, int* sem, int target,
                                            uint64_t* stage_empty, unsigned long long* times = nullptr) {
#ifdef JAXFLASH_BWD_TIMELINE
  const unsigned long long t0 = times ? timeline_now() : 0;
#endif
  spin_until(sem, target);
#ifdef JAXFLASH_BWD_TIMELINE
  const unsigned long long t1 = times ? timeline_now() : 0;
#endif
  fence_proxy_async_global();
  if (target == 0) bulk_store_f32(tile, stage, bytes);
  else bulk_reduce_add_f32(tile, stage, bytes);
  bulk_commit();
  bulk_wait_reads();
  mbar_arrive_if(stage_empty, true);
  flush_dq_turn(sem, 0);
#ifdef JAXFLASH_BWD_TIMELINE
  if (times) {
    times[0] += t1 - t0;
    times[1] += timeline_now() - t1;
    ++times[2];
  }
#else
  (void)times;
#endif
}

}  // namespace jaxflash::gpu
