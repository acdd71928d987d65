// The one parameter block every jaxflash kernel reads (CPU and CUDA alike).
//
// The FFI handlers decode XLA's buffers and attributes into an AttentionParams;
// the kernels never see XLA types. Every array is described by strides over an
// "instance space" (the batch-like axes: batch, kv-head, query-group and any
// axis jax.vmap adds) plus its own row/column strides, so a vmapped axis at any
// position becomes a stride instead of a transpose, and a broadcast operand
// (shared K/V under vmap, a bias without a batch axis, GQA) is a zero stride.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define JF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JF_HOST_DEVICE inline
#endif

namespace jaxflash {

// Python merges and drops instance axes before lowering, so in practice two or
// three remain (batch, kv-head, group); eight leaves room for nested vmaps.
constexpr int kMaxInstanceDims = 8;

// The kernels' exponent base is 2: log2(e) turns a natural logit into base-2 units.
constexpr float kLog2e = 1.4426950408889634f;

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Bytes per element; 0 for a value outside the enum (a decoding error).
JF_HOST_DEVICE int dtype_bytes(DType t) {
  return t == DType::kF32 ? 4 : (t == DType::kF16 || t == DType::kBF16) ? 2 : 0;
}

// One operand seen as [instance..., row, col], strides in elements.
//   q, k, v, o, d_o, dq, dk, dv : row = sequence position, col = feature (head dim: head_dim
//                                 for q, k, dq, dk; value_head_dim for v, o, d_o, dv)
//   bias, mask, dbias           : row = query position,    col = key position
//   lse                         : row = query position,    col = hi, lo (2 floats; below)
//   delta                       : row = query position,    col unused
//   q_lens, kv_lens             : instance strides only
//   seed                        : col = word (2 uint32 per instance, 4 with kDropoutOffsets), no rows
//   q_segment_ids, kv_segment_ids : row = query / key position, no cols
//   alibi_slopes                  : instance strides only (one slope per query head)
//   dalibi                        : row = key position,   col unused (the query heads' instances)
//   dalibi_centre                 : row = query position, col unused
//   dscale                        : row = key position, col unused
//   dscale_centre                 : row = query position, col unused
//   scale_operand                 : instance strides only (one scale per instance)
// data == nullptr means the operand is absent.
struct ArrayView {
  void* data = nullptr;
  int64_t inst_stride[kMaxInstanceDims] = {};
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

// Bits of AttentionParams::flags (jaxflash/contract.py's Flag). The presence of
// optional operands is also visible as data != nullptr; the flags let handlers
// cross-check the two.
enum Flags : int64_t {
  kHasBias = 1 << 0,
  kHasMask = 1 << 1,
  kHasQLens = 1 << 2,
  kHasKvLens = 1 << 3,
  kBottomRight = 1 << 4,  // align the causal/window diagonal to the ends (kv_len - q_len)
  kHasDbias = 1 << 6,     // backward: write dbias
  kOutputF32 = 1 << 7,    // forward: o is float32 whatever dtype (the backward's residual)
  // float32 inputs: fp32-accurate products via 3xTF32, what precision="highest"
  // asks for; ignored for 16-bit dtypes, whose operands are exact in the MMA already.
  kExactF32 = 1 << 8,
  kDropout = 1 << 9,  // attention dropout on P (see dropout.h); needs seed
  // q_segment_ids and kv_segment_ids (packed sequences): key s is visible from query t only
  // if their ids are equal (segment_visible below).
  kHasSegmentIds = 1 << 10,
  // alibi_slopes: the logits get -slope * |s - t - offset| (alibi_slope below).
  kHasAlibi = 1 << 11,
  kHasDalibi = 1 << 12,  // backward: write dalibi (needs kHasAlibi), reading dalibi_centre
  // The scale is the float32 scale operand's value for the instance (instance_scale below),
  // read when the kernel runs (a traced scale; AttentionParams::scale is then unused), and the
  // backward writes dq in float32 and without the scale factor: the gradient g of the scaled
  // query scale·q, from which jaxflash/attention.py forms dq = scale·g, rounded once to the
  // input dtype (the scale's own gradient is dscale's, below).
  kScaleOperand = 1 << 13,
  kHasDscale = 1 << 14,  // backward: write dscale (needs kScaleOperand), reading dscale_centre
  // The seed operand also holds the place of the call's block in the whole problem (its words
  // 2 and 3: the first query row's and key's positions; dropout.h), which the dropout's hash
  // adds to the block's own: ring attention's blocks drop what the unsharded call drops.
  kDropoutOffsets = 1 << 15,
};

// Sentinel for an unbounded side of the attention window.
constexpr int64_t kUnbounded = -1;

// The CUDA kernels hold positions in 32-bit integers: T and S below 2^28, and the
// diagonal offset inside (-2^28, 2^28), keep every sum of a position, the offset and a
// window side inside an int (cuda/gpu/primitives/positions.h). jaxflash/kernels.py
// refuses longer sequences when it lowers for CUDA, naming the argument.
constexpr int64_t kCudaMaxSeqLen = int64_t{1} << 28;

// Dropout decides an entry from 16 bits of a hash (dropout.h): keep_threshold is
// round(kDropoutResolution * (1 - rate)), in [1, kDropoutResolution].
constexpr int64_t kDropoutResolution = int64_t{1} << 16;

struct AttentionParams {
  DType dtype = DType::kF32;       // q, k, v, o, d_o, dq, dk, dv
  DType bias_dtype = DType::kF32;  // bias and dbias: dtype or float32
  int64_t flags = 0;

  int num_inst_dims = 0;
  int64_t inst_size[kMaxInstanceDims] = {};

  int64_t seqlen_q = 0;  // T
  int64_t seqlen_k = 0;  // S
  int64_t head_dim = 0;  // H: the features of q and k (and dq, dk)
  // Hv: the features of v, and so of o, d_o and dv. jax.nn has Hv = H; the CPU kernels take any
  // Hv (MLA-style (192, 128) heads), the CUDA handlers refuse Hv != H (cuda_handlers.cu): the
  // CUDA lowering sends them such a call zero-padded to one head dim max(H, Hv) instead.
  int64_t value_head_dim = 0;

  float scale = 1.f;  // logits = scale * q.k + bias (without kScaleOperand: instance_scale)
  // With kScaleOperand (a traced scale): float32, one scale per instance, stride 0 along the
  // axes it is shared by (vmap gives each mapped item its own; instance_scale below).
  ArrayView scale_operand;

  // Key s is visible from query t iff  -window_left <= s - t - offset <= window_right,
  // offset = diagonal_offset + (0 (top-left, jax.nn) or kv_len - q_len (bottom-right));
  // kUnbounded drops a side. is_causal is window_right = 0. diagonal_offset places the
  // blocks in a longer sequence: ring attention computes query block [a, a + T) against
  // key block [b, b + S) of one sequence with diagonal_offset = a - b.
  int64_t window_left = kUnbounded;
  int64_t window_right = kUnbounded;
  int64_t diagonal_offset = 0;

  // Attention dropout (kDropout): entry (t, s) of P is kept iff its 16 bits of the hash
  // are below keep_threshold (dropout.h's keep), and the kept entries are scaled by
  // keep_scale = 1 / (1 - rate). The softmax's normaliser, and so
  // lse, is that of the undropped P.
  uint32_t keep_threshold = 0;
  float keep_scale = 1.f;

  // Logit soft-cap (0: none): the logits are cap * tanh(scale * q.k / cap), before the bias
  // is added and the masks apply (FlashAttention's order). The CUDA kernels run it in their
  // general variants (mma.sync; not the sm_90 ones yet).
  float softcap = 0.f;

  // Forward operands and results.
  ArrayView q, k, v, bias, mask, q_lens, kv_lens;  // mask: uint8 (XLA PRED); lens: int32
  // uint32: the dropout seed of each instance (2 words), and with kDropoutOffsets the row and
  // column offsets of the call's block (2 more, dropout.h). Words on the device, not attributes:
  // ring attention's offsets depend on the device, and one SPMD program runs on all of them.
  ArrayView seed;
  ArrayView q_segment_ids, kv_segment_ids;         // int32, one id per query / key position
  ArrayView alibi_slopes;                          // float32, one slope per instance (query head)
  // lse: float32, in base 2, as an unevaluated sum of two floats per row, col 0 = hi and
  // col 1 = lo: hi + lo = log2 Σ_s 2^(log2(e)·logit) exactly as the forward formed it
  // (LseSplit below); hi = -inf, lo = 0 for a row that sees no key. The backward
  // recomputes P = 2^(s - hi - lo): with logits of 1e4 one float's ulp there is ~1e-3,
  // so a single rounded lse would move every recomputed probability by up to ~0.07%
  // (dk, dq 1e3x jax.nn's error); hi and lo keep it exact. Base 2 is the kernels' own unit
  // (their softmax runs on exp2), so nothing converts between forward and backward.
  // jaxflash/attention.py hands callers hi·ln 2, the natural log.
  ArrayView o, lse;

  // Backward operands and results (unused by the forward). delta is
  // Δ = rowsum(dO ∘ O) - dlse per query row (float32), computed by XLA from the
  // float32 output: Δ from an output already rounded to 16 bits would make the
  // gradients of peaked attention (and of a per-row bias) visibly worse than
  // jax.nn's.
  ArrayView d_o, delta;
  ArrayView dq, dk, dv, dbias;
  // dalibi (kHasDalibi): float32, per key row s of each query-head instance (laid out as delta's
  // instance axes with a row per key: dk's rows, dq's instances), that key's share of the slope's
  // gradient centred on the rows' C_t = |E_t - t - offset| (E: dalibi_centre, below):
  // -Σ_t dS(t, s)·(|s - t - offset| - C_t) (dS: the gradient of the logit, before a soft-cap's
  // slope). Python sums it over the rows (and the axes the slopes are broadcast along) and, where
  // the lse is differentiated, subtracts Σ_t C_t·dlse_t, what the centre took out (each row of dS
  // sums to the lse's cotangent); it forms C as the kernels do (t + offset exact in float32). Per key row, so that each element has one writer on both
  // platforms: the CUDA backward's CTAs own key tiles and visit every query of the GQA group's heads
  // (per query row would need a reduction across CTAs); the sum needs no atomics or tile-size contract.
  ArrayView dalibi;
  // dscale (kHasDscale): float32, laid out as dk without its features (dk's instance strides, a
  // row per key): partial sums of a traced scale's gradient Σ dS·(q·k - C) (C: dscale_centre,
  // below), dS the gradient of the scaled product scale·q·k (the soft-cap's slope included; its
  // centre's share is taken with dS of the logits) and q·k unscaled, over the queries
  // and the instances that dk sums over. Only the sum over the rows is defined: the CPU kernels
  // write each key's own sum, the CUDA kernels a key tile's sum in its first row and 0 in the
  // others. Python sums it (and over the axes the scale is shared along). Formed in the
  // kernels because both factors are float32 there: the same sum from dq (Σ q∘dq) carries the
  // CUDA kernels' rounding of dS to the input dtype before dS·K, which this sum, cancelling
  // heavily (each row of dS sums to 0), amplifies past jax.nn's error.
  ArrayView dscale;
  // dscale_centre (with kHasDscale): float32, per query row t of each instance (delta's layout), the
  // row's centre C_t: the kernels sum dS·(∂logit/∂scale - C_t) with dS of the logits, i.e.
  // dS·(slope·q·k - C_t) (slope = 1 without a soft-cap), instead of dS·slope·q·k. Each row of dS
  // sums to the lse's cotangent in exact arithmetic, and Python adds C·dlse back, so any C gives
  // the same gradient. But delta comes from the forward's O, whose P·V product rounded P to the
  // input dtype, so the kernels' rows of dS sum to a small residue besides, which the uncentred sum
  // multiplies by the row's P-mean of slope·q·k and the centred one by that mean less C: XLA forms
  // C with one more forward call, E_t = Σ_s P(t, s)·(q_t·k_s) = q·attention(q, k, v = k) (P before
  // dropout), and C = E, or under a soft-cap E·(1 - tanh²(scale·E/cap)) (docs/DESIGN.md).
  ArrayView dscale_centre;
  // dalibi_centre (with kHasDalibi): float32, per query row t of each instance (delta's layout),
  // E_t, the row's P-mean key position Σ_s P(t, s)·s from one more forward call (XLA; 0 for rows
  // that see no key), from which the kernels form the row's centre C_t = |E_t - (t + offset)| of
  // dalibi's sum, the P-mean distance wherever the row's keys lie on one side of the diagonal. They
  // sum dS·(|d| - C_t), not dS·|d|: the forward's P·V rounds P to the input dtype, so each row of the
  // kernels' dS sums to a small residue besides the lse's cotangent, which the uncentred sum
  // multiplies by the row's mean distance (as large as T for rows far from the keys; docs/DESIGN.md).
  // Any E is exact in exact arithmetic; the kernels compute C so that Python need not know t and
  // the offset, except where the lse is differentiated.
  ArrayView dalibi_centre;

  JF_HOST_DEVICE bool has(int64_t flag) const { return (flags & flag) != 0; }

  JF_HOST_DEVICE int64_t num_instances() const {
    int64_t n = 1;
    for (int d = 0; d < num_inst_dims; ++d) n *= inst_size[d];
    return n;
  }
};

// Element offset of instance `linear` (row-major over inst_size) in `view`. Index: int64_t,
// or int where every instance index fits in one, which makes the divisions 32-bit (the
// persistent sm_90 forward's producer decodes each tile in 24 registers: fwd_sm90_kernel.h).
template <class Index>
JF_HOST_DEVICE int64_t instance_offset(const AttentionParams& p, const ArrayView& view, Index linear) {
  int64_t offset = 0;
  for (int d = p.num_inst_dims - 1; d >= 0; --d) {
    const Index size = static_cast<Index>(p.inst_size[d]);
    const Index i = linear % size;
    linear /= size;
    offset += i * view.inst_stride[d];
  }
  return offset;
}

// The visible rows and keys of one instance, after sequence lengths.
struct InstanceBounds {
  int64_t q_len;   // rows >= q_len are padding: output 0, no gradient
  int64_t kv_len;  // keys >= kv_len are never visible
  int64_t offset;  // diagonal offset (see window_left)
};

// The forward computes P as 2^-p_shift times the probability, p_shift = ceil(log2(seqlen_k))
// (a power of two, folded into the exp2's offset, so free): the unnormalised sum of P·V then
// stays below max|v| where it could reach seqlen_k·max|v| and overflow float32 (bf16 / f32
// values near 3e38). The row sums carry the factor and the lse takes it out.
inline float probability_shift(int64_t seqlen_k) {
  return ceilf(log2f(static_cast<float>(seqlen_k > 1 ? seqlen_k : 1)));
}

// The lse's two floats (see AttentionParams::lse): hi = fl(offset + log2_sum) and lo its
// rounding error, so hi + lo == offset + log2_sum exactly (Knuth's TwoSum, valid whatever
// the magnitudes). `offset` is the exact float the forward subtracted before its exp2 (row
// max and p_shift included), log2_sum the log2 of the row's sum of those powers.
struct LseSplit {
  float hi, lo;
};
JF_HOST_DEVICE LseSplit split_lse(float offset, float log2_sum) {
  const float hi = offset + log2_sum;
  const float b = hi - offset;
  return {hi, (offset - (hi - b)) + (log2_sum - b)};
}

// The bounds of instance `linear` (Index: as instance_offset's).
template <class Index>
JF_HOST_DEVICE InstanceBounds instance_bounds(const AttentionParams& p, Index linear) {
  InstanceBounds b{p.seqlen_q, p.seqlen_k, p.diagonal_offset};
  if (p.has(kHasQLens)) {
    const int32_t n = static_cast<const int32_t*>(p.q_lens.data)[instance_offset(p, p.q_lens, linear)];
    b.q_len = n < 0 ? 0 : (n > p.seqlen_q ? p.seqlen_q : n);
  }
  if (p.has(kHasKvLens)) {
    const int32_t n = static_cast<const int32_t*>(p.kv_lens.data)[instance_offset(p, p.kv_lens, linear)];
    b.kv_len = n < 0 ? 0 : (n > p.seqlen_k ? p.seqlen_k : n);
  }
  if (p.has(kBottomRight)) b.offset += b.kv_len - b.q_len;
  return b;
}

// ALiBi: the logit of query t and key s gets -slope * |s - t - b.offset|, the distance from
// the diagonal that causal masking and windows use (top-left: |s - t|, bottom-right:
// |s - t - (kv_len - q_len)|, FlashAttention's |i + seqlen_k - seqlen_q - j|; ring blocks:
// positions in the whole sequence). Added after the soft-cap, with the bias, as FlashAttention
// adds it. The slope of one instance; 0 without kHasAlibi.
JF_HOST_DEVICE float alibi_slope(const AttentionParams& p, int64_t linear) {
  if (!p.has(kHasAlibi)) return 0.f;
  return static_cast<const float*>(p.alibi_slopes.data)[instance_offset(p, p.alibi_slopes, linear)];
}

// The scale of one instance: the scale operand's (kScaleOperand) or the attribute.
JF_HOST_DEVICE float instance_scale(const AttentionParams& p, int64_t linear) {
  if (!p.has(kScaleOperand)) return p.scale;
  return static_cast<const float*>(p.scale_operand.data)[instance_offset(p, p.scale_operand, linear)];
}

// Whether key s is visible from query t by position alone (window, causal,
// lengths); the dense mask is applied separately.
JF_HOST_DEVICE bool position_visible(const AttentionParams& p, const InstanceBounds& b, int64_t t,
                                     int64_t s) {
  if (t >= b.q_len || s >= b.kv_len) return false;
  const int64_t d = s - t - b.offset;
  if (p.window_left != kUnbounded && d < -p.window_left) return false;
  if (p.window_right != kUnbounded && d > p.window_right) return false;
  return true;
}

// The segment ids of one instance (null without kHasSegmentIds), and whether query t's and key
// s's ids are equal, the packed-sequence mask; like the dense mask, it is applied on top of the
// positional visibility.
struct SegmentIds {
  const int32_t* q = nullptr;   // instance base; element t at t * q_stride
  const int32_t* kv = nullptr;  // instance base; element s at s * kv_stride
  int64_t q_stride = 0, kv_stride = 0;

  JF_HOST_DEVICE int32_t query(int64_t t) const { return q[t * q_stride]; }
  JF_HOST_DEVICE int32_t key(int64_t s) const { return kv[s * kv_stride]; }
  JF_HOST_DEVICE bool visible(int64_t t, int64_t s) const { return !q || query(t) == key(s); }
};

JF_HOST_DEVICE SegmentIds segment_ids(const AttentionParams& p, int64_t linear) {
  SegmentIds ids;
  if (!p.has(kHasSegmentIds)) return ids;
  ids.q = static_cast<const int32_t*>(p.q_segment_ids.data) + instance_offset(p, p.q_segment_ids, linear);
  ids.kv = static_cast<const int32_t*>(p.kv_segment_ids.data) + instance_offset(p, p.kv_segment_ids, linear);
  ids.q_stride = p.q_segment_ids.row_stride;
  ids.kv_stride = p.kv_segment_ids.row_stride;
  return ids;
}

// The range of ids [lo, hi] of a run of rows (queries or keys); two tiles whose ranges do not
// overlap have no pair of equal ids, so no visible pair: the kernels skip them whole.
struct IdRange {
  int32_t lo, hi;
  JF_HOST_DEVICE bool meets(const IdRange& other) const { return lo <= other.hi && other.lo <= hi; }
  // One id on both sides: every pair matches, so no element needs the test.
  JF_HOST_DEVICE bool all_equal(const IdRange& other) const {
    return lo == hi && other.lo == other.hi && lo == other.lo;
  }
};

// Half-open key range [lo, hi) that rows [t0, t1) can see by position; the
// tiles outside it are skipped entirely. Empty when lo >= hi.
struct KeyRange {
  int64_t lo, hi;
};

JF_HOST_DEVICE KeyRange visible_keys(const AttentionParams& p, const InstanceBounds& b, int64_t t0,
                                     int64_t t1) {
  if (t1 > b.q_len) t1 = b.q_len;
  if (t0 >= t1) return {0, 0};
  int64_t lo = 0, hi = b.kv_len;
  if (p.window_left != kUnbounded) {
    const int64_t first = t0 + b.offset - p.window_left;
    if (first > lo) lo = first;
  }
  if (p.window_right != kUnbounded) {
    const int64_t last = (t1 - 1) + b.offset + p.window_right + 1;
    if (last < hi) hi = last;
  }
  if (hi < lo) hi = lo;
  return {lo, hi};
}

// Half-open query range [lo, hi) that keys [s0, s1) are visible from by
// position (the transpose of visible_keys), for the K/V-outer backward pass.
JF_HOST_DEVICE KeyRange visible_queries(const AttentionParams& p, const InstanceBounds& b,
                                        int64_t s0, int64_t s1) {
  if (s1 > b.kv_len) s1 = b.kv_len;
  if (s0 >= s1) return {0, 0};
  int64_t lo = 0, hi = b.q_len;
  if (p.window_right != kUnbounded) {  // s - t - offset <= right  =>  t >= s - offset - right
    const int64_t first = s0 - b.offset - p.window_right;
    if (first > lo) lo = first;
  }
  if (p.window_left != kUnbounded) {  // s - t - offset >= -left  =>  t <= s - offset + left
    const int64_t last = (s1 - 1) - b.offset + p.window_left + 1;
    if (last < hi) hi = last;
  }
  if (hi < lo) hi = lo;
  return {lo, hi};
}

}  // namespace jaxflash
