// The forward epilogue of one warp: normalise O once, write lse, and stage O
// through shared memory so the global stores are whole 16-byte chunks of rows.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernel_traits.h"
#include "primitives/mma.h"
#include "primitives/positions.h"
#include "primitives/smem_tile.h"
#include "primitives/softmax.h"
#include "../params.h"

namespace jaxflash::gpu {

// float32 O (kOutputF32, the backward's residual) straight from registers: a
// lane's two adjacent columns are one float2 and a quad covers 32 contiguous
// bytes of a row, whole sectors, so there is nothing to gain from staging.
template <class Cfg>
__device__ __forceinline__ void store_o_f32(const AttentionParams& p, const FwdRuntime& rt, float* out, int row0,
                                            const float (&o)[Cfg::kMF][Cfg::kDF][4], int lane) {
  const int head_dim = static_cast<int>(p.head_dim);
#pragma unroll
  for (int mf = 0; mf < Cfg::kMF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
      if (row0 + r >= p.seqlen_q) continue;
      float* row = out + r * p.o.row_stride;
#pragma unroll
      for (int df = 0; df < Cfg::kDF; ++df) {
        const int col = frag_col(df, 0, lane);
        const float x = o[mf][df][2 * h], y = o[mf][df][2 * h + 1];
        if (rt.o_vec && col + 2 <= head_dim) {
          *reinterpret_cast<float2*>(row + col) = make_float2(x, y);
        } else {
          if (col < head_dim) row[col] = x;
          if (col + 1 < head_dim) row[col + 1] = y;
        }
      }
    }
}

// The warp's rows [m0 + warp_row, + kWarpRows) of o and lse, up to their last step: O
// normalised, lse stored, and O, where it is 16-bit, staged in the warp's own rows of sO (which
// only this warp read, as Q; __syncwarp'd), for the caller to store: true then. float32 O
// (kOutputF32) goes to o_origin from registers: false.
template <class Cfg>
__device__ __forceinline__ bool forward_epilogue_stage(const AttentionParams& p, const FwdRuntime& rt,
                                                       const Positions& pos, void* o_origin, float* lse_origin,
                                                       int m0, const typename Cfg::QTile& sO,
                                                       float (&o)[Cfg::kMF][Cfg::kDF][4],
                                                       const typename Cfg::State& st, int tid) {
  using T = typename Cfg::T;
  const int lane = tid % 32;
  const int warp_row = (tid / 32) * Cfg::kWarpRows;
  const int row0 = m0 + warp_row;

  bool live[Cfg::kMF][2];
#pragma unroll
  for (int mf = 0; mf < Cfg::kMF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) live[mf][h] = row0 + frag_row(mf, 2 * h, lane) < pos.q_len;
  const auto as_operand = [](float x) { return PvOps<T, Cfg::kF32Mma>::as_operand(x); };
  softmax_finalize(o, st, rt.out_scale, live, rt.exp_scale, !p.has(kDropout), as_operand,
                   [&](int mf, int h, LseSplit lse) {
    const int t = row0 + frag_row(mf, 2 * h, lane);
    // One lane of each quad owns the row.
    if (lse_origin != nullptr && (lane & 3) == 0 && t < p.seqlen_q) {
      lse_origin[t * p.lse.row_stride] = lse.hi;
      lse_origin[t * p.lse.row_stride + p.lse.col_stride] = lse.lo;
    }
  });

  if (p.has(kOutputF32)) {
    store_o_f32<Cfg>(p, rt, static_cast<float*>(o_origin) + row0 * p.o.row_stride, row0, o, lane);
    return false;
  }

  // Registers -> shared, in T. Each lane writes 2 adjacent columns of a row.
#pragma unroll
  for (int mf = 0; mf < Cfg::kMF; ++mf)
#pragma unroll
    for (int df = 0; df < Cfg::kDF; ++df)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row + frag_row(mf, 2 * h, lane), col = frag_col(df, 0, lane);
        const float x = o[mf][df][2 * h], y = o[mf][df][2 * h + 1];
        if constexpr (std::is_same_v<T, float>)
          sO.template at<float2>(row, col) = make_float2(x, y);
        else
          sO.template at<uint32_t>(row, col) = pack2(x, y, T{});
      }
  __syncwarp();
  return true;
}

// The whole epilogue by the threads themselves (the mma.sync kernel's): the staged rows from
// shared to global memory, rows up to T (padding rows hold zeros), columns up to head_dim.
template <class Cfg>
__device__ __forceinline__ void forward_epilogue(const AttentionParams& p, const FwdRuntime& rt,
                                                 const Positions& pos, void* o_origin, float* lse_origin, int m0,
                                                 const typename Cfg::QTile& sO, float (&o)[Cfg::kMF][Cfg::kDF][4],
                                                 const typename Cfg::State& st, int tid) {
  if (!forward_epilogue_stage<Cfg>(p, rt, pos, o_origin, lse_origin, m0, sO, o, st, tid)) return;
  const int lane = tid % 32;
  const int warp_row = (tid / 32) * Cfg::kWarpRows;
  const int row0 = m0 + warp_row;
  using T = typename Cfg::T;
  T* out = static_cast<T*>(o_origin) + row0 * p.o.row_stride;
  const int rows = max(min(static_cast<int>(p.seqlen_q) - row0, Cfg::kWarpRows), 0);
  store_tile_rows<32, Cfg::kWarpRows>(sO, warp_row, out, p.o.row_stride, rows, static_cast<int>(p.head_dim),
                                      rt.o_vec, lane);
}

}  // namespace jaxflash::gpu
