// Tile primitives of the CPU kernels: strided loads into dense float32 tiles,
// the three small matrix products attention needs, and the logits epilogue
// (bias, masking). The forward and backward kernels are written in these terms
// so that they read like the algorithm.
//
// Every product keeps its vector dimension on a contiguous, unit-stride row of
// the destination, so no float sum is reassociated (results do not depend on
// the vector width); that is why K is loaded transposed for Q·Kᵀ.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cuda/cpu/isa.h"
#include "cuda/cpu/numeric.h"
#include "cuda/dropout.h"
#include "cuda/params.h"

namespace jaxflash::cpu {

// Rows of Q and keys of K/V per tile: 64 x 64 float tiles keep one task's
// working set (Q, K, V, O tiles at head dim 256 plus the 64 x 64 logits) in L2.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;

constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <class T>
inline const T* element(const ArrayView& a, int64_t offset) {
  return static_cast<const T*>(a.data) + offset;
}
template <class T>
inline T* mutable_element(const ArrayView& a, int64_t offset) {
  return static_cast<T*>(a.data) + offset;
}

// dst[i * ld + d] = scale * src[i * row_stride + d * col_stride], rows x cols.
template <class T>
void load_tile(const T* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
               float scale, float* dst, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = src + i * row_stride;
    float* out = dst + i * ld;
    for (int64_t d = 0; d < cols; ++d) out[d] = scale * to_float(row[d * col_stride]);
  }
}

// dst[d * ld + i] = src[i * row_stride + d * col_stride]: the transposed tile.
template <class T>
void load_tile_transposed(const T* src, int64_t row_stride, int64_t col_stride, int64_t rows,
                          int64_t cols, float* dst, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = src + i * row_stride;
    for (int64_t d = 0; d < cols; ++d) dst[d * ld + i] = to_float(row[d * col_stride]);
  }
}

// dst[i * row_stride + d * col_stride] = scale * src[i * ld + d].
template <class T>
void store_tile(const float* src, int64_t ld, int64_t rows, int64_t cols, float scale, T* dst,
                int64_t row_stride, int64_t col_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* in = src + i * ld;
    T* row = dst + i * row_stride;
    for (int64_t d = 0; d < cols; ++d) row[d * col_stride] = from_float<T>(scale * in[d]);
  }
}

template <class T>
void store_zero_rows(int64_t rows, int64_t cols, T* dst, int64_t row_stride, int64_t col_stride) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t d = 0; d < cols; ++d) dst[i * row_stride + d * col_stride] = from_float<T>(0.f);
}

// The three products, register-blocked: each micro-kernel keeps an MR x 16
// block of C in vector registers (8 of 16 on AVX2) and streams the reduction
// dimension, so every loaded vector feeds MR fused multiply-adds. The 16-wide
// dimension is always a contiguous destination row whose buffer is padded to a
// multiple of 16 (kVec); the row-like dimensions are handled exactly, with an
// MR = 1 remainder, because partially filled tiles hold stale rows there.
typedef float vec8 __attribute__((vector_size(32)));
constexpr int64_t kVec = 16;

inline vec8 load8(const float* p) {
  vec8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, vec8 v) { __builtin_memcpy(p, &v, sizeof(v)); }
inline int64_t round_up_vec(int64_t n) { return (n + kVec - 1) / kVec * kVec; }

// C[m x n] = A[m x k] · Bt[k x n]  (Bt is B transposed, row-major). Columns of C
// up to round_up_vec(n) are written; Bt and C must be that wide.
// The reduction (the head dim, up to 256) is summed in chunks of kSumChunk, each
// chunk's sum then added to C: a float32 sum of k terms in one running
// accumulator has a rounding error growing like k, in chunks like
// k / kSumChunk + kSumChunk. At logits of 1e4 that halves the logits' error,
// to what XLA's dot has; python -m jaxflash.bench saw no cost (median 0.993x).
constexpr int64_t kSumChunk = 16;

template <int MR>
inline void matmul_block(const float* a, int64_t lda, const float* bt, int64_t ldb, int64_t k,
                         float* c, int64_t ldc) {
  for (int64_t d0 = 0; d0 < k; d0 += kSumChunk) {
    vec8 acc[MR][2] = {};
    const int64_t d1 = std::min(k, d0 + kSumChunk);
    for (int64_t d = d0; d < d1; ++d) {
      const vec8 b0 = load8(bt + d * ldb), b1 = load8(bt + d * ldb + 8);
      for (int r = 0; r < MR; ++r) {
        const float ar = a[r * lda + d];
        acc[r][0] += ar * b0;
        acc[r][1] += ar * b1;
      }
    }
    for (int r = 0; r < MR; ++r) {
      if (d0 > 0) acc[r][0] += load8(c + r * ldc), acc[r][1] += load8(c + r * ldc + 8);
      store8(c + r * ldc, acc[r][0]);
      store8(c + r * ldc + 8, acc[r][1]);
    }
  }
}

inline void matmul(const float* a, int64_t lda, const float* bt, int64_t ldb, int64_t m, int64_t n,
                   int64_t k, float* c, int64_t ldc) {
  for (int64_t j = 0; j < n; j += kVec) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) matmul_block<4>(a + i * lda, lda, bt + j, ldb, k, c + i * ldc + j, ldc);
    for (; i < m; ++i) matmul_block<1>(a + i * lda, lda, bt + j, ldb, k, c + i * ldc + j, ldc);
  }
}

// C[m x n] += A[m x k] · B[k x n]; B and C padded to round_up_vec(n) columns.
template <int MR>
inline void matmul_acc_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k,
                             float* c, int64_t ldc) {
  vec8 acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = load8(c + r * ldc);
    acc[r][1] = load8(c + r * ldc + 8);
  }
  for (int64_t j = 0; j < k; ++j) {
    const vec8 b0 = load8(b + j * ldb), b1 = load8(b + j * ldb + 8);
    for (int r = 0; r < MR; ++r) {
      const float ar = a[r * lda + j];
      acc[r][0] += ar * b0;
      acc[r][1] += ar * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store8(c + r * ldc, acc[r][0]);
    store8(c + r * ldc + 8, acc[r][1]);
  }
}

inline void matmul_acc(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t m,
                       int64_t n, int64_t k, float* c, int64_t ldc) {
  for (int64_t d = 0; d < n; d += kVec) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) matmul_acc_block<4>(a + i * lda, lda, b + d, ldb, k, c + i * ldc + d, ldc);
    for (; i < m; ++i) matmul_acc_block<1>(a + i * lda, lda, b + d, ldb, k, c + i * ldc + d, ldc);
  }
}

// C[k x n] += Aᵀ · B for A[m x k], B[m x n]  (dV += Pᵀ·dO, dK += dSᵀ·Q); B and C
// padded to round_up_vec(n) columns.
template <int MR>
inline void matmul_tn_acc_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t m,
                                float* c, int64_t ldc) {
  vec8 acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = load8(c + r * ldc);
    acc[r][1] = load8(c + r * ldc + 8);
  }
  for (int64_t i = 0; i < m; ++i) {
    const vec8 b0 = load8(b + i * ldb), b1 = load8(b + i * ldb + 8);
    for (int r = 0; r < MR; ++r) {
      const float ar = a[i * lda + r];
      acc[r][0] += ar * b0;
      acc[r][1] += ar * b1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    store8(c + r * ldc, acc[r][0]);
    store8(c + r * ldc + 8, acc[r][1]);
  }
}

inline void matmul_tn_acc(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t m,
                          int64_t n, int64_t k, float* c, int64_t ldc) {
  for (int64_t d = 0; d < n; d += kVec) {
    int64_t j = 0;
    for (; j + 4 <= k; j += 4) matmul_tn_acc_block<4>(a + j, lda, b + d, ldb, m, c + j * ldc + d, ldc);
    for (; j < k; ++j) matmul_tn_acc_block<1>(a + j, lda, b + d, ldb, m, c + j * ldc + d, ldc);
  }
}

// 2^v for v in [-127, 127], written so that the loops calling it vectorise
// (std::exp2 does not, and would dominate the softmax): round to the nearest
// integer k, 2^f for f in [-1/2, 1/2] by a degree-7 Taylor polynomial of e^(f·ln2)
// (relative error below 1e-8, under float rounding), times 2^k built in the
// exponent bits; 0 below 2^-126.
inline float exp2_clamped(float c) {
  constexpr float kRound = 12582912.f;  // 1.5·2^23: (v + kRound) - kRound rounds v to an integer
  const float k = (c + kRound) - kRound;
  const float t = (c - k) * kLn2;
  float poly = 1.f / 5040.f;
  poly = poly * t + 1.f / 720.f;
  poly = poly * t + 1.f / 120.f;
  poly = poly * t + 1.f / 24.f;
  poly = poly * t + 1.f / 6.f;
  poly = poly * t + 0.5f;
  poly = poly * t + 1.f;
  poly = poly * t + 1.f;
  const int32_t e = static_cast<int32_t>(k);
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return e < -126 ? 0.f : poly * scale;
}

// x[j] = 2^((x[j] - hi) - lo) for j < n (hi + lo: an offset kept in two floats, params.h's
// lse; the forward passes lo = 0). -inf gives 0; NaN stays NaN.
inline void exp2_shifted(float* x, int64_t n, float hi, float lo = 0.f) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = (x[j] - hi) - lo;
    const bool nan = v != v;
    const float r = exp2_clamped(nan ? 0.f : (v < -127.f ? -127.f : (v > 127.f ? 127.f : v)));
    x[j] = nan ? v : r;
  }
}

// The soft-cap of one row of n logits, in place: x[j] = cap·tanh(x[j] / cap), and with slope
// (the backward's) slope[j] = (1 + t)(1 - t) for t = tanh(x[j] / cap). Vectorised like
// exp2_shifted (std::tanh made the capped forward 2.6x slower): tanh|u| = (1 - e) / (1 + e)
// with e = 2^(-2|u| log2 e), |u| clamped to 9 (tanh 9 is 1 in float). Its absolute error is
// a few float ulps of 1, so the capped logit's is a few ulps of cap. NaN stays NaN.
inline void soft_cap_row(float* x, int64_t n, float cap, float* slope) {
  const float inv_cap = 1.f / cap;
  for (int64_t j = 0; j < n; ++j) {
    const float u = x[j] * inv_cap;
    const bool nan = u != u;
    const float a = nan ? 0.f : (u < 0.f ? -u : u);
    const float e = exp2_clamped(-2.f * kLog2e * (a > 9.f ? 9.f : a));
    const float magnitude = (1.f - e) / (1.f + e);
    const float t = u < 0.f ? -magnitude : magnitude;
    x[j] = nan ? u : cap * t;
    if (slope) slope[j] = (1.f + t) * (1.f - t);
  }
}

// The per-instance operand bases the logits epilogue reads.
template <class BiasT>
struct LogitsInputs {
  const BiasT* bias = nullptr;   // instance base, or null
  const uint8_t* mask = nullptr; // instance base, or null
  SegmentIds segments;           // without segment ids: null bases
  float alibi_slope = 0.f;       // log2e * the instance's ALiBi slope (base-2 logits); 0: none
};

template <class BiasT>
LogitsInputs<BiasT> logits_inputs(const AttentionParams& p, int64_t inst) {
  LogitsInputs<BiasT> in;
  if (p.has(kHasBias)) in.bias = element<BiasT>(p.bias, instance_offset(p, p.bias, inst));
  if (p.has(kHasMask)) in.mask = element<uint8_t>(p.mask, instance_offset(p, p.mask, inst));
  in.segments = segment_ids(p, inst);
  in.alibi_slope = kLog2e * alibi_slope(p, inst);
  return in;
}

// Whether every query of rows [t0, t0+rows) and key of [s0, s0+cols) has one and the same
// segment id (or there are none), so that no element of the tile needs the id test.
inline bool one_segment(const SegmentIds& ids, int64_t t0, int64_t rows, int64_t s0, int64_t cols) {
  if (!ids.q) return true;
  const int32_t id = ids.query(t0);
  for (int64_t i = 1; i < rows; ++i)
    if (ids.query(t0 + i) != id) return false;
  for (int64_t j = 0; j < cols; ++j)
    if (ids.key(s0 + j) != id) return false;
  return true;
}

// The ALiBi distances |s - t - offset| of row t, keys [s0, s0+cols) (params.h, alibi_slope), as
// floats: exact below 2^24, which is what the float logits can resolve anyway. Vectorised:
// the row's distance at s0 plus j, then its absolute value.
inline void alibi_distances(const InstanceBounds& b, int64_t t, int64_t s0, int64_t cols, float* distance) {
  const float first = static_cast<float>(s0 - t - b.offset);
  for (int64_t j = 0; j < cols; ++j) distance[j] = std::fabs(first + static_cast<float>(j));
}

// Turns S = (scale·log2e)·Q·Kᵀ for rows [t0, t0+rows) and keys [s0, s0+cols)
// into base-2 logits: soft-caps them (params.h: c·tanh(S / c), c = log2e·cap in
// these units), adds log2e·bias and -log2e·slope·|s - t - offset| (ALiBi, after the cap as
// FlashAttention adds it) and sets invisible entries to -inf. cap_slope
// (the backward's, with a soft-cap): receives d(capped)/dS = 1 - tanh^2, by which
// the backward turns dS of the logits into dS of Q·Kᵀ.
template <class BiasT>
void finish_logits(const AttentionParams& p, const InstanceBounds& b, const LogitsInputs<BiasT>& in,
                   int64_t t0, int64_t rows, int64_t s0, int64_t cols, float* s, int64_t ld,
                   float* cap_slope = nullptr) {
  if (p.softcap > 0.f) {
    for (int64_t i = 0; i < rows; ++i)  // the slope as jax's tanh JVP forms it
      soft_cap_row(s + i * ld, cols, kLog2e * p.softcap, cap_slope ? cap_slope + i * ld : nullptr);
  }
  if (in.bias) {
    for (int64_t i = 0; i < rows; ++i) {
      const BiasT* row = in.bias + (t0 + i) * p.bias.row_stride + s0 * p.bias.col_stride;
      for (int64_t j = 0; j < cols; ++j) s[i * ld + j] += kLog2e * to_float(row[j * p.bias.col_stride]);
    }
  }
  if (in.alibi_slope != 0.f) {
    float distance[kBlockK];
    for (int64_t i = 0; i < rows; ++i) {
      alibi_distances(b, t0 + i, s0, cols, distance);
      float* si = s + i * ld;
      for (int64_t j = 0; j < cols; ++j) si[j] -= in.alibi_slope * distance[j];
    }
  }
  // Tiles wholly inside the window and the lengths need no element test.
  const bool rows_in = t0 + rows <= b.q_len;
  const bool cols_in = s0 + cols <= b.kv_len;
  const int64_t d_min = s0 - (t0 + rows - 1) - b.offset;
  const int64_t d_max = (s0 + cols - 1) - t0 - b.offset;
  const bool window_in = (p.window_left == kUnbounded || d_min >= -p.window_left) &&
                         (p.window_right == kUnbounded || d_max <= p.window_right);
  if (rows_in && cols_in && window_in && !in.mask && one_segment(in.segments, t0, rows, s0, cols)) return;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = t0 + i;
    const uint8_t* mrow = in.mask ? in.mask + t * p.mask.row_stride : nullptr;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t key = s0 + j;
      const bool visible = position_visible(p, b, t, key) && (!mrow || mrow[key * p.mask.col_stride]) &&
                           in.segments.visible(t, key);
      if (!visible) s[i * ld + j] = kNegInf;
    }
  }
}

// Attention dropout on row t of P, keys [s0, s0 + cols): the entries it drops
// become P * 0 (the kept ones are scaled by keep_scale later, once per output).
// A product, not a 0: a NaN P stays NaN, as in jax.nn's math with dropout.
inline void drop_row(const DropoutKey& dropout, int64_t t, int64_t s0, int64_t cols, float* p) {
  const uint32_t row_key = dropout.row_key(t);
  for (int64_t j = 0; j < cols; ++j) p[j] *= dropout.keep(row_key, s0 + j) ? 1.f : 0.f;
}

// Instance-space bookkeeping for the passes that reduce over some instance axes
// (the K/V-outer backward reduces over the query heads of a GQA group, and dbias
// over the axes the bias broadcasts along). `reduce_mask` has bit d set for each
// reduced axis; tasks enumerate the remaining axes.
struct InstanceSplit {
  const AttentionParams* p;
  uint32_t reduce_mask;

  int64_t count(bool reduced) const {
    int64_t n = 1;
    for (int d = 0; d < p->num_inst_dims; ++d)
      if (((reduce_mask >> d) & 1u) == static_cast<uint32_t>(reduced)) n *= p->inst_size[d];
    return n;
  }
  // The linear instance index whose kept axes are `kept` and reduced axes `reduced`.
  int64_t compose(int64_t kept, int64_t reduced) const {
    int64_t linear = 0, scale = 1;
    for (int d = p->num_inst_dims - 1; d >= 0; --d) {
      int64_t& source = ((reduce_mask >> d) & 1u) ? reduced : kept;
      const int64_t i = source % p->inst_size[d];
      source /= p->inst_size[d];
      linear += i * scale;
      scale *= p->inst_size[d];
    }
    return linear;
  }
  // The index among count(false) of `linear`'s kept axes: compose's inverse on them.
  int64_t kept_of(int64_t linear) const {
    int64_t kept = 0, scale = 1;
    for (int d = p->num_inst_dims - 1; d >= 0; --d) {
      const int64_t i = linear % p->inst_size[d];
      linear /= p->inst_size[d];
      if (!((reduce_mask >> d) & 1u)) {
        kept += i * scale;
        scale *= p->inst_size[d];
      }
    }
    return kept;
  }
};

// The instance axes (bits) along which an array is shared: stride 0, size > 1.
inline uint32_t broadcast_axes(const AttentionParams& p, const ArrayView& a) {
  uint32_t bits = 0;
  for (int d = 0; d < p.num_inst_dims; ++d)
    if (p.inst_size[d] > 1 && a.inst_stride[d] == 0) bits |= 1u << d;
  return bits;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The id range (params.h, IdRange) of every tile of `tile_rows` rows of one side's segment
// ids, computed once per call before the tasks start, one row of tiles per distinct id row
// (the instances the ids are broadcast along, such as the heads, share one).
class TileIdRanges {
 public:
  TileIdRanges() = default;
  TileIdRanges(const AttentionParams& p, const ArrayView& ids, int64_t length, int64_t tile_rows)
      : split_{&p, broadcast_axes(p, ids)}, tiles_(ceil_div(length, tile_rows)), tile_rows_(tile_rows) {
    const int64_t rows = split_.count(false);
    ranges_.resize(rows * tiles_);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* base = static_cast<const int32_t*>(ids.data) + instance_offset(p, ids, split_.compose(r, 0));
      for (int64_t tile = 0; tile < tiles_; ++tile) {
        const int64_t first = tile * tile_rows, last = std::min(length, first + tile_rows);
        IdRange range{base[first * ids.row_stride], base[first * ids.row_stride]};
        for (int64_t i = first + 1; i < last; ++i) {
          const int32_t id = base[i * ids.row_stride];
          range.lo = std::min(range.lo, id);
          range.hi = std::max(range.hi, id);
        }
        ranges_[r * tiles_ + tile] = range;
      }
    }
  }

  // The ids' range over rows [r0, r1) (r0 < r1) of instance `inst`: the union of the tiles
  // those rows touch, a superset where they start or end inside a tile.
  IdRange over(int64_t inst, int64_t r0, int64_t r1) const {
    const IdRange* row = ranges_.data() + split_.kept_of(inst) * tiles_;
    IdRange range = row[r0 / tile_rows_];
    for (int64_t tile = r0 / tile_rows_ + 1; tile <= (r1 - 1) / tile_rows_; ++tile) {
      range.lo = std::min(range.lo, row[tile].lo);
      range.hi = std::max(range.hi, row[tile].hi);
    }
    return range;
  }

 private:
  InstanceSplit split_{};
  int64_t tiles_ = 0, tile_rows_ = 1;
  std::vector<IdRange> ranges_;
};

// Both sides' tile id ranges, for skipping whole tiles of packed sequences: a Q tile and a
// K/V tile whose id ranges do not meet have no visible pair.
class SegmentTileRanges {
 public:
  explicit SegmentTileRanges(const AttentionParams& p) {
    if (!p.has(kHasSegmentIds)) return;
    present_ = true;
    queries_ = TileIdRanges(p, p.q_segment_ids, p.seqlen_q, kBlockQ);
    keys_ = TileIdRanges(p, p.kv_segment_ids, p.seqlen_k, kBlockK);
  }

  // Whether rows [t0, t1) and keys [s0, s1) of instance `inst` may hold a pair of equal ids;
  // always without segment ids.
  bool may_meet(int64_t inst, int64_t t0, int64_t t1, int64_t s0, int64_t s1) const {
    return !present_ || queries_.over(inst, t0, t1).meets(keys_.over(inst, s0, s1));
  }

 private:
  bool present_ = false;
  TileIdRanges queries_, keys_;
};

}  // namespace jaxflash::cpu
