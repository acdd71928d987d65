// Query / key positions of one instance in 32-bit integers, and the geometry
// of the position mask (lengths, causal / window diagonal) over score blocks.
// Pointers stay 64-bit everywhere; only positions are narrowed, so the
// per-tile bookkeeping costs single registers in a kernel short of them.
#pragma once

#include <cstdint>

#include "../../params.h"

namespace jaxflash::gpu {

// launch_forward refuses T or S >= 2^28 (params.h's kCudaMaxSeqLen). Then |t|,
// |s|, |offset| < 2^28 and |s - t - offset| < 3 * 2^28 < 2^30, so a window side
// of 2^30 excludes nothing (it stands for kUnbounded and for anything wider),
// and every sum below of a position, the offset and a window side stays inside
// an int.
constexpr int64_t kMaxSeqLen = kCudaMaxSeqLen;
constexpr int kOpenSide = 1 << 30;

// Key s is visible from query t iff t < q_len, s < kv_len and
// -window_left <= s - t - offset <= window_right: params.h's position_visible().
struct Positions {
  int q_len, kv_len, offset, window_left, window_right;

  __device__ __forceinline__ static int side(int64_t w) {
    return w == kUnbounded || w >= kOpenSide ? kOpenSide : static_cast<int>(w);
  }
  __device__ __forceinline__ Positions(const AttentionParams& p, const InstanceBounds& b)
      : q_len(static_cast<int>(b.q_len)),
        kv_len(static_cast<int>(b.kv_len)),
        offset(static_cast<int>(b.offset)),
        window_left(side(p.window_left)),
        window_right(side(p.window_right)) {}
};

// The visible keys of each row of a block whose first row is query row0 and
// first column key col0, relative to the block: row r sees columns
// [r + lo, r + hi) clipped to [0, kv_end), none when r >= q_end.
struct BlockWindow {
  int lo, hi, kv_end, q_end;

  __device__ __forceinline__ BlockWindow(const Positions& pos, int row0, int col0) {
    const int diag = row0 + pos.offset - col0;  // column of row 0's diagonal
    lo = diag - pos.window_left;
    hi = diag + pos.window_right + 1;
    kv_end = pos.kv_len - col0;
    q_end = pos.q_len - row0;
  }
};

// The key tiles [n0, n0 + kBlockN) that every row in [m0, last_row] sees
// whole, by position: lo <= n0 <= hi. They skip the position mask (the fast
// path). Rows past q_len are left out of last_row: the epilogue drops them.
template <int kBlockN>
struct FullTiles {
  int lo, hi;

  __device__ __forceinline__ FullTiles(const Positions& pos, int m0, int last_row)
      : lo(last_row + pos.offset - pos.window_left),  // the last row sees back to n0
        hi(min(pos.kv_len - kBlockN,                                        // keys < kv_len
               m0 + pos.offset + pos.window_right - (kBlockN - 1))) {}      // the first row sees the tile's end
  __device__ __forceinline__ bool contain(int n0) const { return lo <= n0 && n0 <= hi; }
};

}  // namespace jaxflash::gpu
