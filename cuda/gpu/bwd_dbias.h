// The dbias kernel: dbias = dS, summed over whatever the bias is broadcast
// along. Kept out of the main kernel (which would need a second ordered
// cross-CTA reduction for broadcast biases); it recomputes P and dS (two of
// the main kernel's five GEMMs) and is deterministic by construction: every
// output element has one owning CTA, which sums its terms in a fixed order
// (key tile, then instance, then Q tile) and reduces rows / columns with a
// fixed shuffle + shared-memory tree.
//
// A CTA owns, for one dbias-kept instance (its other axes, `dbias_reduced`
// instances, are summed inside):
//   one Q tile x every key tile          full dbias      (writes each tile as it goes)
//   one Q tile, summed over key tiles    one column      (dbias col stride 0, S > 1)
//   one key tile, summed over Q tiles    one row         (dbias row stride 0, T > 1)
//   everything                           one row and col
#pragma once

#include <cstdint>

#include "bwd_kernel_traits.h"
#include "bwd_scores.h"
#include "instance.h"
#include "primitives/warp_gemm.h"
#include "primitives/smem_tile.h"
#include "../params.h"

namespace jaxflash::gpu {

template <class U>
__device__ __forceinline__ U from_float(float x) {
  if constexpr (std::is_same_v<U, __half>) return __float2half_rn(x);
  else if constexpr (std::is_same_v<U, __nv_bfloat16>) return __float2bfloat16_rn(x);
  else return x;
}

template <class Cfg, class BiasT>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    dbias_kernel(const __grid_constant__ AttentionParams p, const BwdRuntime launch_rt) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int MF = Cfg::kSMF, NF = Cfg::kSNF;
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  extern __shared__ __align__(128) char smem[];
  const QTile sQ{smem}, sdO{smem + QTile::kBytes};
  const KTile sK{smem + 2 * QTile::kBytes}, sV{smem + 2 * QTile::kBytes + KTile::kBytes};
  float* red = reinterpret_cast<float*>(smem);  // reduction scratch, once the tiles are done
  static_assert(Cfg::kSWarpsM * BN * 4 <= 2 * QTile::kBytes && (Cfg::kSWarpsN + 1) * BM * 4 <= 2 * QTile::kBytes,
                "reduction scratch fits in the Q / dO tiles");

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / Cfg::kSWarpsN, wn = warp % Cfg::kSWarpsN;
  const int row0 = wm * Cfg::kSRows, col0 = wn * Cfg::kSCols;
  const int head_dim = static_cast<int>(p.head_dim);
  const bool one_row = launch_rt.dbias_one_row, one_col = launch_rt.dbias_one_col;

  int64_t kept, i_begin = 0, i_end = launch_rt.q_tiles, j_begin = 0, j_end = launch_rt.k_tiles;
  if (one_row && one_col) {
    kept = blockIdx.x;
  } else if (one_row) {
    kept = blockIdx.x / launch_rt.k_tiles;
    j_begin = blockIdx.x % launch_rt.k_tiles, j_end = j_begin + 1;
  } else {
    kept = blockIdx.x / launch_rt.q_tiles;
    i_begin = blockIdx.x % launch_rt.q_tiles, i_end = i_begin + 1;
  }
  const int64_t out_linear = compose_instance(p, launch_rt.dbias_reduce_mask, kept, 0);
  const BwdRuntime rt = with_scale_operand(p, launch_rt, out_linear);
  const InstanceIndex out_inst(p, out_linear);
  BiasT* out = out_inst.origin<BiasT>(p, p.dbias);
  const int64_t out_rs = p.dbias.row_stride, out_cs = p.dbias.col_stride;

  float acc[MF][NF][4];
  zero_frags(acc);

  // Tiles now in shared memory, to skip reloading them.
  const T* q_res = nullptr;
  const T* do_res = nullptr;
  const T* k_res = nullptr;
  const T* v_res = nullptr;
  int q_rows_res = -1, k_rows_res = -1;

#pragma unroll 1
  for (int64_t j = j_begin; j < j_end; ++j) {
    const int64_t n0 = j * BN;
#pragma unroll 1
    for (int64_t r = 0; r < rt.dbias_reduced; ++r) {
      const int64_t linear = compose_instance(p, rt.dbias_reduce_mask, kept, r);
      const InstanceBounds b = instance_bounds(p, linear);
      const InstanceIndex inst(p, linear);
      ScoreInputs in{nullptr, nullptr, rt.lse2 + linear * rt.t_pad, rt.lse2_lo + linear * rt.t_pad,
                     rt.delta + linear * rt.t_pad, nullptr};
      in.bias = rt.bias_f32 ? static_cast<const void*>(inst.origin<const float>(p, p.bias))
                            : static_cast<const void*>(inst.origin<const T>(p, p.bias));
      if (p.has(kHasMask)) in.mask = inst.origin<const uint8_t>(p, p.mask);
      if (p.has(kDropout)) in.seed = inst.origin<const uint32_t>(p, p.seed);
      in.alibi2 = 1.4426950408889634f * alibi_slope(p, linear);
      constexpr bool ids = Cfg::kSegmentIds;
      if (ids) {
        in.q_ids = inst.origin<const int32_t>(p, p.q_segment_ids);
        in.kv_ids = inst.origin<const int32_t>(p, p.kv_segment_ids);
      }
#pragma unroll 1
      for (int64_t i = i_begin; i < i_end; ++i) {
        const int64_t m0 = i * BM;
        const KeyRange keys = visible_keys(p, b, m0, m0 + BM);
        if (keys.lo >= keys.hi || keys.hi <= n0 || keys.lo >= n0 + BN) continue;  // all dS = 0
        if (ids && !rt.segments.may_meet(linear, i, j)) continue;  // no equal ids: all dS = 0 too
        in.segment_test = ids && rt.segments.needs_test(linear, i, j);

        const T* q = inst.origin<const T>(p, p.q) + m0 * p.q.row_stride;
        const T* d_o = inst.origin<const T>(p, p.d_o) + m0 * p.d_o.row_stride;
        const T* k = inst.origin<const T>(p, p.k) + n0 * p.k.row_stride;
        const T* v = inst.origin<const T>(p, p.v) + n0 * p.v.row_stride;
        const int q_rows = static_cast<int>(min(b.q_len - m0, int64_t{BM}));
        const int k_rows = static_cast<int>(min(b.kv_len - n0, int64_t{BN}));
        // Same origins and row counts (the zero fill) = same tile contents.
        const bool load_q = q != q_res || d_o != do_res || q_rows != q_rows_res;
        const bool load_k = k != k_res || v != v_res || k_rows != k_rows_res;
        if (load_q || load_k) {
          __syncthreads();  // every warp is done with the tiles being replaced
          if (load_q) {
            load_tile<kThreads>(sQ, q, p.q.row_stride, q_rows, head_dim, rt.q_vec, tid);
            load_tile<kThreads>(sdO, d_o, p.d_o.row_stride, q_rows, head_dim, rt.do_vec, tid);
            q_res = q, do_res = d_o, q_rows_res = q_rows;
          }
          if (load_k) {
            load_tile<kThreads>(sK, k, p.k.row_stride, k_rows, head_dim, rt.k_vec, tid);
            load_tile<kThreads>(sV, v, p.v.row_stride, k_rows, head_dim, rt.v_vec, tid);
            k_res = k, v_res = v, k_rows_res = k_rows;
          }
          cp_async_commit();
          cp_async_wait<0>();
          __syncthreads();
        }
        float pr[MF][NF][4], ds[MF][NF][4];
        probs_and_dscores<Cfg, /*kDsOfLogits=*/true>(pr, ds, p, rt, b, in, m0, n0, tile_pair_full<BM, BN>(p, b, m0, n0), sQ, sK, sdO, sV,
                               row0, col0, lane);
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int nf = 0; nf < NF; ++nf)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mf][nf][e] += ds[mf][nf][e];
      }
    }

    if (one_col) continue;  // summed over key tiles: written at the end
    if (!one_row) {
      // The (i_begin, j) tile, as is. Rows up to T and keys up to S (zeros
      // where nothing is visible).
      const int64_t m0 = i_begin * BM;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int64_t t = m0 + row0 + frag_row(mf, e, lane), s = n0 + col0 + frag_col(nf, e, lane);
            if (t < p.seqlen_q && s < p.seqlen_k) out[t * out_rs + s * out_cs] = from_float<BiasT>(acc[mf][nf][e]);
          }
    } else {
      // Column sums: lane, then across the 8 row groups of the warp, then the
      // warp rows in order through shared memory.
      float col[NF][2];
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float x = 0.f;
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) x += acc[mf][nf][c] + acc[mf][nf][2 + c];
          x += __shfl_xor_sync(0xffffffffu, x, 4);
          x += __shfl_xor_sync(0xffffffffu, x, 8);
          x += __shfl_xor_sync(0xffffffffu, x, 16);
          col[nf][c] = x;
        }
      __syncthreads();  // tiles no longer read: reuse as scratch
      if (lane < 4)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int c = 0; c < 2; ++c) red[wm * BN + col0 + frag_col(nf, c, lane)] = col[nf][c];
      __syncthreads();
      if (tid < BN && n0 + tid < p.seqlen_k) {
        float x = 0.f;
        for (int w = 0; w < Cfg::kSWarpsM; ++w) x += red[w * BN + tid];
        out[(n0 + tid) * out_cs] = from_float<BiasT>(x);
      }
      q_res = k_res = nullptr;  // the scratch overwrote sQ / sdO
    }
    zero_frags(acc);
  }

  if (!one_col) return;
  // Row sums: lane, quad, then the warp columns in order.
  float rowsum[MF][2];
  lane_row_sums(acc, rowsum);
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rowsum[mf][h] += __shfl_xor_sync(0xffffffffu, rowsum[mf][h], 1);
      rowsum[mf][h] += __shfl_xor_sync(0xffffffffu, rowsum[mf][h], 2);
    }
  __syncthreads();
  if ((lane & 3) == 0)
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) red[wn * BM + row0 + frag_row(mf, 2 * h, lane)] = rowsum[mf][h];
  __syncthreads();
  if (tid < BM) {
    float x = 0.f;
    for (int w = 0; w < Cfg::kSWarpsN; ++w) x += red[w * BM + tid];
    if (!one_row) {
      const int64_t t = i_begin * BM + tid;
      if (t < p.seqlen_q) out[t * out_rs] = from_float<BiasT>(x);
    } else {
      red[Cfg::kSWarpsN * BM + tid] = x;
    }
  }
  if (!one_row) return;
  __syncthreads();
  if (tid == 0) {
    float x = 0.f;
    for (int t = 0; t < BM; ++t) x += red[Cfg::kSWarpsN * BM + t];
    out[0] = from_float<BiasT>(x);
  }
}

}  // namespace jaxflash::gpu
