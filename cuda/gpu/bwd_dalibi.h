// ALiBi's slope gradient in the mma.sync backward's general variant (kHasDalibi, params.h):
// dalibi[instance, s] = -Σ_t dS(t, s)·(|s - t - offset| - C_t), per key row s of each query-head
// instance, dS that of the logits (before a soft-cap's slope), C_t = |E_t - (t + offset)| the rows'
// centres from dalibi_centre's E (the P-mean key position; params.h).
//
// Why per key row: a CTA owns a key tile and walks every Q tile of the instances that share its
// K / V (a GQA group's query heads), so each (query-head instance, key row) has exactly one CTA,
// and the sum over its queries needs no reduction across CTAs, no atomics and no tile-size
// contract. (Per query row, the CPU kernels' first layout, each row's sum would be spread over
// the CTAs of every key tile.) The slope's gradient is the sum over all rows either way, which
// Python forms (attention.py, _slopes_gradient).
//
// How: each tile pair, after dS is formed in registers, every lane weights its scores by
// |d| - C_t and sums them per key column over its fragment rows; a warp-wide reduce-scatter over
// the 8 lane groups that share those columns (dalibi_share) leaves each lane the tile pair's sum
// of one column, which it adds into that column's slot of its warp row in shared memory
// (add_dalibi_share: one owner per slot, so no race; a slot rather than a register held across the
// Q-tile loop, where the general variant's registers are scarce). When the instance's Q tiles are
// done, one thread per key row adds the slots of the warp rows that share the column (the S grid's
// kSWarpsM) in warp order, stores, and clears them for the next instance (store_dalibi). Every
// step has a fixed order: bitwise deterministic.
#pragma once

#include <cstdint>
#include <cstdlib>

#include "instance.h"
#include "primitives/warp_gemm.h"
#include "../params.h"

namespace jaxflash::gpu {

// A lane's fragment columns: 2·NF of them (frag_col(nf, c, lane), c = 0, 1), shared with the lanes
// of the same lane % 4, one per row group g = lane / 4. The reduce-scatter below halves the live
// columns at each of the lane bits 4, 3, 2 (g's bits, high first) while there are two or more,
// keeping the half that the bit selects, and adds the partner's values; once one column is left, the
// remaining levels add plain. So a lane ends with the warp's sum of column index
// Σ_levels bit·half of its original 2·NF (dalibi_column), and lanes differing only in the plain
// levels' bits (2·NF < 8) hold the same column's sum, bit for bit (a + b = b + a).
template <int kLevel, int kLive, int N>
__device__ __forceinline__ void column_sum_levels(float (&v)[N], int lane) {
  if constexpr (kLevel < 3) {
    constexpr int kMask = 16 >> kLevel;
    if constexpr (kLive > 1) {
      constexpr int kHalf = kLive / 2;
      const bool upper = (lane & kMask) != 0;
#pragma unroll
      for (int k = 0; k < kHalf; ++k) {
        const float keep = upper ? v[kHalf + k] : v[k], send = upper ? v[k] : v[kHalf + k];
        v[k] = keep + __shfl_xor_sync(0xffffffffu, send, kMask);
      }
      column_sum_levels<kLevel + 1, kHalf>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], kMask);
      column_sum_levels<kLevel + 1, 1>(v, lane);
    }
  }
}

// The column of the warp block (0 .. 8·NF - 1) whose sum column_sum_levels leaves in `lane`.
template <int NF>
__device__ __forceinline__ int dalibi_column(int lane) {
  static_assert(NF == 1 || NF == 2 || NF == 4, "2, 4 or 8 columns per lane");
  constexpr int N = 2 * NF;
  int index = 0;
#pragma unroll
  for (int level = 0, half = N / 2; half >= 1; ++level, half /= 2)
    if (lane & (16 >> level)) index += half;
  return 8 * (index / 2) + 2 * (lane & 3) + (index & 1);
}

// Whether `lane` is the one that stores its column's sum: the lanes that hold the same column differ
// only in the bits of the plain levels, the low bits of g (none when 2·NF = 8).
template <int NF>
__device__ __forceinline__ bool dalibi_column_owner(int lane) {
  constexpr int kPlainLevels = NF == 4 ? 0 : NF == 2 ? 1 : 2;
  return ((lane >> 2) & ((1 << kPlainLevels) - 1)) == 0;
}

// This tile pair's share of dalibi for the lane's column (dalibi_column): Σ dS·(|d| - C_t) over the
// warp block's rows, ds the warp block's dS of the logits (fp32), its rows starting at query `t0`,
// `diag` its row 0's diagonal column (ScoreBlock::diag: an element's distance is |col - row -
// diag|), `key0` the position t0 + offset of row 0's diagonal key, `centre` the instance's rows of
// dalibi_centre (E_t; each row's centre is |E_t - (key0 + row)|, key0 + row exact in a float).
// Rows past T read row T - 1's E (their dS is 0). Every lane of the warp calls it (shuffles).
// Not inlined: the general variant runs at 240-255 registers, and this code, inlined where dS is
// live, cost every call of the copies that have it spills whether it ran or not (nvcc 13, bytes
// of spill stores / loads against the kernels without it: f32 D = 128 sm_90a general +24 / +24,
// soft-cap copy +48 / +48; called, +4 / +4 and +16 / +16, docs/DESIGN.md). The call passes ds
// through local memory (the stack frame), on the dalibi path only.
template <int MF, int NF>
__device__ __noinline__ float dalibi_share(const float (&ds)[MF][NF][4], int diag, int key0, const float* centre,
                                              int64_t centre_row_stride, int64_t t0, int64_t seqlen_q, int lane) {
  float cols[2 * NF] = {};
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row(mf, 2 * h, lane);
      const float c = fabsf(__ldg(centre + min(t0 + r, seqlen_q - 1) * centre_row_stride) -
                            static_cast<float>(key0 + r));
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float distance = static_cast<float>(abs(frag_col(nf, j, lane) - r - diag));  // exact (< 2^24)
          cols[2 * nf + j] = fmaf(ds[mf][nf][2 * h + j], distance - c, cols[2 * nf + j]);
        }
    }
  column_sum_levels<0, 2 * NF>(cols, lane);
  return cols[0];
}

// The CTA's slots: per warp row of the S grid and key column of the tile, the sum over the
// current instance's Q tiles so far (static shared memory, kSWarpsM x BN floats: 1 KB at most).
template <class Cfg>
__device__ __forceinline__ float (&dalibi_slots())[Cfg::kSWarpsM][Cfg::kBlockN] {
  __shared__ float slots[Cfg::kSWarpsM][Cfg::kBlockN];
  return slots;
}

// Clears the slots, before the first instance (the Q-tile loop's first barrier orders it before
// the first add_dalibi_share). Every thread of the CTA calls it.
template <class Cfg>
__device__ __forceinline__ void clear_dalibi(int tid) {
  static_assert(Cfg::kBlockN <= Cfg::kThreads, "a thread per key column of the tile");
  if (tid < Cfg::kBlockN)
#pragma unroll
    for (int m = 0; m < Cfg::kSWarpsM; ++m) dalibi_slots<Cfg>()[m][tid] = 0.f;
}

// Adds a tile pair's dalibi_share into the lane's slot (its warp row, its column of the warp
// block at s_col0): only the lane that owns the column writes, and always the same one.
template <class Cfg>
__device__ __forceinline__ void add_dalibi_share(float share, int warp, int lane) {
  if (dalibi_column_owner<Cfg::kSNF>(lane))
    dalibi_slots<Cfg>()[warp / Cfg::kSWarpsN][(warp % Cfg::kSWarpsN) * Cfg::kSCols + dalibi_column<Cfg::kSNF>(lane)] +=
        share;
}

// The instance's rows [n0, n0 + BN) of dalibi from the slots: after a CTA barrier (every warp's
// last add_dalibi_share), thread j adds column j's slots in warp-row order, stores the negation
// (rows past S are not stored; rows past kv_len get 0: their dS is 0) and clears them; the Q-tile
// loop's barriers order that before the next instance's adds. Every thread of the CTA calls it.
template <class Cfg>
__device__ __forceinline__ void store_dalibi(const AttentionParams& p, int64_t linear, int64_t n0, int tid) {
  constexpr int BN = Cfg::kBlockN;
  __syncthreads();
  if (tid >= BN) return;
  float sum = 0.f;
#pragma unroll
  for (int m = 0; m < Cfg::kSWarpsM; ++m) {
    sum += dalibi_slots<Cfg>()[m][tid];
    dalibi_slots<Cfg>()[m][tid] = 0.f;
  }
  if (tid >= static_cast<int>(min(p.seqlen_k - n0, int64_t{BN}))) return;
  const InstanceIndex out(p, linear);  // dalibi is per query head: every instance has its own
  out.origin<float>(p, p.dalibi)[(n0 + tid) * p.dalibi.row_stride] = -sum;
}

// Zeros into the instance's rows [n0, n0 + BN) of dalibi, for an instance whose queries do not
// see these keys (the CTA skips it): every element of dalibi has its one writer.
template <int BN>
__device__ __forceinline__ void zero_dalibi(const AttentionParams& p, int64_t linear, int64_t n0, int tid) {
  const int rows_out = static_cast<int>(min(p.seqlen_k - n0, int64_t{BN}));
  if (tid >= rows_out) return;
  const InstanceIndex out(p, linear);
  out.origin<float>(p, p.dalibi)[(n0 + tid) * p.dalibi.row_stride] = 0.f;
}

}  // namespace jaxflash::gpu
