// Standalone check of jaxflash::gpu::launch_backward against a naive double
// precision CPU reference, on small odd shapes that hit every feature: tails,
// causal / window / bottom-right, GQA (zero instance strides on K/V and dK/dV),
// sequence lengths with empty rows and an instance with no key, broadcast
// biases with dbias (over batch, over heads + keys, over heads + queries, a
// scalar), masks with a fully masked row, segment ids (documents, documents on
// tile boundaries, ids in any order; with dbias too), the logit soft-cap and
// ALiBi (alone, together, with ids), dlse, unaligned rows, NaN in the rows past
// the lengths, four instance axes (no TMA descriptor: the sm_90 fallback), every
// padded head dim, all three dtypes (f32 on tf32 MMAs, and with kExactF32 on 3xTF32,
// held to fp32 accuracy), a traced scale (the scale operand: dq of the scaled query in
// float32, and dscale's partial sums, centred on the host's fp64 dscale_centre, plus the
// centre's Σ C·dlse, against Σ dS·(q·k) per kv instance), ALiBi's slope gradient ("dslope"
// cases: dalibi per key row of each query head against the fp64 reference of each row, with the
// centre C_t = |E_t - t - offset| from the host's E, and its rows' sum plus Σ C·dlse against
// -Σ dS·|s - t - offset| per query head); then bitwise determinism at a larger size.
// o and lse come from the reference (fp64, rounded to the kernel's inputs), so
// the test does not depend on the forward kernel. Like the FFI handler, every
// case passes delta = rowsum(dO o O) - dlse (from the exact output) and no o.
//
// Build (from the repository root; cmake/cuda.cmake's JAXFLASH_BUILD_SELFTESTS):
//   cmake -S . -B /tmp/selftests -DJAXFLASH_CUDA=ON -DJAXFLASH_CUDA_ARCHITECTURES=90a \
//         -DJAXFLASH_BUILD_SELFTESTS=ON && cmake --build /tmp/selftests --target bwd_selftest
// Run: /tmp/selftests/bwd_selftest          correctness + determinism, exit status 0 iff all pass
//      /tmp/selftests/bwd_selftest bench    also time the bf16 backward at FlashAttention's benchmark shapes
//      /tmp/selftests/bwd_selftest quick    correctness only (for compute-sanitizer)
//      /tmp/selftests/bwd_selftest bench-only [D N causal|full [packed]]
//                                 only the timing, optionally of one shape (e.g. for ncu)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../backward.h"
#include "../timeline.h"
#include "selftest_util.h"

namespace {

// Bias shapes (all broadcast to B, N, T, S); dbias has the bias's shape.
enum class Bias {
  kNone,
  kHeads,      // (N, T, S) in dtype: broadcast over batch
  kFullF32,    // (B, N, T, S) f32
  kRowsF32,    // (B, T) f32: col stride 0, broadcast over heads and keys
  kKeysF32,    // (B, S) f32: row stride 0, broadcast over heads and queries
  kScalarF32,  // (1,) f32: every stride 0
};
enum class Mask { kNone, kRandom, kKeyPadding };  // (B,T,S) + a fully masked row | (S)
enum class Layout { kBTNH, kBNTH };                // q, o, d_o, dq; k, v, dk, dv are BSKH

struct Case {
  std::string name;
  DType dtype;
  int B, N, K, T, S, H;
  int64_t window_left = kUnb, window_right = kUnb;
  bool bottom_right = false;
  Bias bias = Bias::kNone;
  bool dbias = false;
  Mask mask = Mask::kNone;
  bool lens = false;
  bool dlse = false;
  Layout layout = Layout::kBTNH;
  float scale = 0.f;   // 0: 1 / sqrt(H)
  bool exact = false;  // kExactF32 (float32 only): 3xTF32 MMAs, fp32-accurate
  Segments segments = Segments::kNone;
  float softcap = 0.f;  // the logit soft-cap, 0 for none
  bool alibi = false;   // ALiBi: a slope per query head (alibi_slope_of)
  bool traced_scale = false;  // the scale as an operand (kScaleOperand), with kHasDscale
  bool dslope = false;        // ALiBi's slope gradient (kHasDalibi): dalibi and its centre
  bool nan_padding = false;   // NaN in q / dO rows past q_len and k / v rows past kv_len
  bool split_batch = false;   // the batch as two instance axes (B even): four that move q
};

Case exact(Case c) { return exact_variant(c); }
Case with_segments(Case c, Segments s) { return segments_variant(c, s); }
Case with_softcap(Case c, float cap) { return softcap_variant(c, cap); }
Case with_alibi(Case c) { return alibi_variant(c); }

// Head n's ALiBi slope: large enough that the distance term moves the logits by several units
// across a tile, different per head.
float alibi_slope_of(int n) { return 0.25f / float(n + 1); }

// Rows that the lengths hide hold NaN: kernels must read them as zeros (the sm_90
// backward's TMA loads them, and its consumers zero them).
Case nan_padded(Case c) {
  c.nan_padding = true;
  c.name += " + NaN padding";
  return c;
}

// Four instance axes that move q and dO, one more than a TMA descriptor holds: the sm_90
// backward falls back to the mma.sync kernels (tma_encode.h).
Case four_axes(Case c) {
  c.split_batch = true;
  c.name += " (batch as 2 axes)";
  return c;
}

Case traced(Case c) {
  c.traced_scale = true;
  c.name = "traced scale " + c.name;
  return c;
}

// ALiBi with its slopes' gradient: the mma.sync general variant, on Hopper too (backward.cu).
Case dslope(Case c) {
  c.alibi = true;
  c.dslope = true;
  c.name = "dslope " + c.name;
  return c;
}

// Everything one case needs on both sides.
struct Problem {
  Case c;
  int G, Hp;  // group size; per-head pitch of q-like and k-like arrays (H + 8 pad columns)
  AttentionParams p;
  HostArray q, k, v, o, d_o;
  std::vector<double> o_exact;               // the output before rounding
  std::vector<float> lse, dlse, delta_in;    // delta_in: rowsum(dO o O_exact) - dlse, BNT; lse BNT x (hi, lo)
  // A traced scale's dscale_centre, BNT: each row's mean q.k under P, in fp64 then rounded (what
  // jaxflash/attention.py forms with a forward call), under a soft-cap times the cap's slope at it.
  std::vector<float> centre;
  // ALiBi's dalibi_centre, BNT: each row's P-mean key position E_t = Σ_s P·s in fp64, rounded (what
  // jaxflash/attention.py forms with a forward call; 0 for a row that sees no key).
  std::vector<float> mean_key;
  HostArray bias;
  std::vector<uint8_t> mask;
  std::vector<int32_t> q_lens, kv_lens;
  std::vector<int32_t> q_ids, kv_ids;  // segment ids, (B, T) and (B, S); empty without them
  size_t bias_n = 0, dbias_n = 0;
  std::vector<float> slopes;  // ALiBi, one per query head; empty without it
  std::unique_ptr<DeviceBuffer> d_q, d_k, d_v, d_do, d_lse, d_delta, d_bias, d_mask, d_lens, d_ids, d_slopes, d_scale,
      d_centre;
  std::unique_ptr<DeviceBuffer> d_dq, d_dk, d_dv, d_dbias, d_dscale, d_ws, d_mean_key, d_dalibi;

  size_t q_index(int b, int n, int t, int h) const {
    const int N = c.N, T = c.T;
    return c.layout == Layout::kBTNH ? ((size_t(b) * T + t) * N + n) * Hp + h : ((size_t(b) * N + n) * T + t) * Hp + h;
  }
  size_t kv_index(int b, int kh, int s, int h) const { return ((size_t(b) * c.S + s) * c.K + kh) * Hp + h; }
  size_t dscale_index(int b, int kh, int s) const { return (size_t(b) * c.S + s) * c.K + kh; }  // dk's rows
  size_t row_index(int b, int n, int t) const { return (size_t(b) * c.N + n) * c.T + t; }  // lse, dlse: BNT
  size_t dalibi_index(int b, int n, int s) const { return (size_t(b) * c.N + n) * c.S + s; }  // BNS
  // The kernels' centre of dalibi's row t: |E_t - (t + offset)| in float (params.h).
  float alibi_centre(int b, int n, int t) const {
    return std::fabs(mean_key[row_index(b, n, t)] - static_cast<float>(t + bounds(b).offset));
  }
  // Bias / dbias element of (b, n, t, s) in its own storage.
  size_t bias_index(int b, int n, int t, int s) const {
    switch (c.bias) {
      case Bias::kHeads: return (size_t(n) * c.T + t) * c.S + s;
      case Bias::kFullF32: return ((size_t(b) * c.N + n) * c.T + t) * c.S + s;
      case Bias::kRowsF32: return size_t(b) * c.T + t;
      case Bias::kKeysF32: return size_t(b) * c.S + s;
      default: return 0;
    }
  }
  jaxflash::InstanceBounds bounds(int b) const {
    jaxflash::InstanceBounds hb{c.T, c.S, 0};
    if (c.lens) hb.q_len = q_lens[b], hb.kv_len = kv_lens[b];
    if (c.bottom_right) hb.offset = hb.kv_len - hb.q_len;
    return hb;
  }
  bool mask_at(int b, int t, int s) const {
    if (c.mask == Mask::kRandom) return mask[(size_t(b) * c.T + t) * c.S + s] != 0;
    if (c.mask == Mask::kKeyPadding) return mask[s] != 0;
    return true;
  }
  bool ids_visible(int b, int t, int s) const {
    return q_ids.empty() || q_ids[size_t(b) * c.T + t] == kv_ids[size_t(b) * c.S + s];
  }

  explicit Problem(const Case& c_, std::mt19937& rng)
      : c(c_),
        G(c_.N / c_.K),
        Hp(c_.H + 8),
        q(c_.dtype, size_t(c_.B) * c_.T * c_.N * (c_.H + 8)),
        k(c_.dtype, size_t(c_.B) * c_.S * c_.K * (c_.H + 8)),
        v(c_.dtype, size_t(c_.B) * c_.S * c_.K * (c_.H + 8)),
        o(c_.dtype, size_t(c_.B) * c_.T * c_.N * (c_.H + 8)),
        d_o(c_.dtype, size_t(c_.B) * c_.T * c_.N * (c_.H + 8)),
        bias(c_.bias == Bias::kHeads ? c_.dtype : DType::kF32, 1) {
    const int B = c.B, N = c.N, K = c.K, T = c.T, S = c.S, H = c.H;
    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    auto fill = [&](HostArray& a, double amp) {  // the rounded values stay in a.val
      for (size_t i = 0; i < a.size(); ++i) a.set(i, amp * uni(rng));
    };
    fill(q, 2.0);
    fill(k, 2.0);
    fill(v, 1.0);
    fill(d_o, 1.0);

    p = AttentionParams{};
    p.dtype = c.dtype;
    p.num_inst_dims = 3;
    p.inst_size[0] = B, p.inst_size[1] = K, p.inst_size[2] = G;  // head n = kh * G + g
    p.seqlen_q = T, p.seqlen_k = S, p.head_dim = H;
    p.scale = c.scale != 0.f ? c.scale : 1.f / std::sqrt(float(H));
    p.window_left = c.window_left, p.window_right = c.window_right;
    if (c.bottom_right) p.flags |= jaxflash::kBottomRight;
    if (c.exact) p.flags |= jaxflash::kExactF32;
    p.softcap = c.softcap;
    if (c.alibi)
      for (int n = 0; n < N; ++n) slopes.push_back(alibi_slope_of(n));

    // Sequence lengths: batch 0 gets kv_len 0 (no key at all) when B > 2, batch 1 a
    // q_len short of T.
    q_lens.assign(B, T), kv_lens.assign(B, S);
    if (c.lens) {
      for (int b = 0; b < B; ++b) {
        q_lens[b] = std::uniform_int_distribution<int>(1, T)(rng);
        kv_lens[b] = std::uniform_int_distribution<int>(1, S)(rng);
      }
      if (B > 2) kv_lens[0] = 0;
      if (B > 1) q_lens[1] = std::max(0, T - 7);
    }
    if (c.nan_padding)
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h) {
          for (int n = 0; n < N; ++n)
            for (int t = q_lens[b]; t < T; ++t) q.set(q_index(b, n, t, h), NAN), d_o.set(q_index(b, n, t, h), NAN);
          for (int kh = 0; kh < K; ++kh)
            for (int s = kv_lens[b]; s < S; ++s) k.set(kv_index(b, kh, s, h), NAN), v.set(kv_index(b, kh, s, h), NAN);
        }
    if (c.segments != Segments::kNone) {
      const uint32_t seed = static_cast<uint32_t>(rng());
      q_ids = segment_ids(c.segments, B, T, -1, seed);
      kv_ids = segment_ids(c.segments, B, S, -2, seed);
    }
    if (c.mask == Mask::kRandom) {
      std::bernoulli_distribution keep(0.8);
      mask.resize(size_t(B) * T * S);
      for (auto& m : mask) m = keep(rng);
      for (int s = 0; s < S; ++s) mask[size_t(T / 2) * S + s] = 0;  // batch 0, row T/2: nothing visible
    } else if (c.mask == Mask::kKeyPadding) {
      std::bernoulli_distribution keep(0.8);
      mask.resize(S);
      for (auto& m : mask) m = keep(rng);
    }
    switch (c.bias) {
      case Bias::kHeads: bias_n = size_t(N) * T * S; break;
      case Bias::kFullF32: bias_n = size_t(B) * N * T * S; break;
      case Bias::kRowsF32: bias_n = size_t(B) * T; break;
      case Bias::kKeysF32: bias_n = size_t(B) * S; break;
      case Bias::kScalarF32: bias_n = 1; break;
      default: bias_n = 0;
    }
    if (bias_n) {
      bias = HostArray(c.bias == Bias::kHeads ? c.dtype : DType::kF32, bias_n);
      fill(bias, 2.0);
    }
    dbias_n = c.dbias ? bias_n : 0;

    // Forward reference: o (rounded to dtype, stored with the padding sentinel
    // 0 in pad columns) and lse.
    lse.assign(size_t(B) * N * T * 2, 0.f);  // hi, lo per row (params.h)
    dlse.assign(size_t(B) * N * T, 0.f);
    std::uniform_real_distribution<float> unif(-1.f, 1.f);
    if (c.dlse)
      for (auto& x : dlse) x = unif(rng);
    o_exact.assign(o.size(), 0.0);
    delta_in.assign(size_t(B) * N * T, 0.f);
    centre.assign(c.traced_scale ? size_t(B) * N * T : 0, 0.f);
    mean_key.assign(c.dslope ? size_t(B) * N * T : 0, 0.f);
    std::vector<double> prob(S);
    for (int b = 0; b < B; ++b)
      for (int n = 0; n < N; ++n) {
        const int kh = n / G;
        for (int t = 0; t < T; ++t) {
          double lse_r;
          probabilities(b, n, t, prob, lse_r);
          const double lse2 = lse_r / std::log(2.0);  // the kernel's base 2, as hi + lo
          const float hi = static_cast<float>(lse2);
          lse[2 * row_index(b, n, t)] = hi;
          lse[2 * row_index(b, n, t) + 1] = std::isinf(hi) ? 0.f : static_cast<float>(lse2 - hi);
          for (int h = 0; h < H; ++h) {
            double acc = 0;
            for (int s = 0; s < S; ++s)
              if (prob[s] != 0) acc += prob[s] * v.val[kv_index(b, kh, s, h)];
            o.set(q_index(b, n, t, h), acc);
            o_exact[q_index(b, n, t, h)] = acc;
          }
          double delta = -dlse[row_index(b, n, t)];
          for (int h = 0; h < H; ++h) delta += d_o.val[q_index(b, n, t, h)] * o_exact[q_index(b, n, t, h)];
          delta_in[row_index(b, n, t)] = static_cast<float>(delta);
          if (c.dslope) {
            double e = 0;
            for (int s = 0; s < S; ++s) e += prob[s] * s;
            mean_key[row_index(b, n, t)] = static_cast<float>(e);
          }
          if (c.traced_scale) {
            double e = 0;
            for (int s = 0; s < S; ++s)
              if (prob[s] != 0) e += prob[s] * qk_dot(b, n, t, s);
            if (c.softcap != 0.f) {  // the mean moved inside the cap's slope, as attention.py
              const double th = std::tanh(p.scale * e / c.softcap);
              e *= 1.0 - th * th;
            }
            centre[row_index(b, n, t)] = static_cast<float>(e);
          }
        }
      }
  }

  // scale q.k of (b, n, t, s), soft-capped (params.h), and the derivative of that capped
  // logit with respect to scale q.k (1 without a cap).
  double qk_dot(int b, int n, int t, int s) const {
    double dot = 0;
    for (int h = 0; h < c.H; ++h) dot += q.val[q_index(b, n, t, h)] * k.val[kv_index(b, n / G, s, h)];
    return dot;
  }
  double capped_logit(int b, int n, int t, int s, double* slope = nullptr) const {
    const double x = p.scale * qk_dot(b, n, t, s);
    if (c.softcap == 0.f) {
      if (slope) *slope = 1.0;
      return x;
    }
    const double th = std::tanh(x / c.softcap);
    if (slope) *slope = 1.0 - th * th;
    return c.softcap * th;
  }

  // Row t of instance (b, n): P (0 where invisible) and lse (-inf if nothing is visible).
  void probabilities(int b, int n, int t, std::vector<double>& prob, double& lse_r) const {
    const int S = c.S;
    const jaxflash::InstanceBounds hb = bounds(b);
    std::vector<double> logit(S, -INFINITY);
    double mx = -INFINITY;
    for (int s = 0; s < S; ++s) {
      if (!jaxflash::position_visible(p, hb, t, s) || !mask_at(b, t, s) || !ids_visible(b, t, s)) continue;
      logit[s] = capped_logit(b, n, t, s) + (bias_n ? bias.val[bias_index(b, n, t, s)] : 0.0);
      if (c.alibi) logit[s] -= slopes[n] * std::fabs(double(s - t - hb.offset));
      mx = std::max(mx, logit[s]);
    }
    double sum = 0;
    for (int s = 0; s < S; ++s) sum += prob[s] = mx == -INFINITY ? 0.0 : std::exp(logit[s] - mx);
    lse_r = sum > 0 ? mx + std::log(sum) : -INFINITY;
    for (int s = 0; s < S; ++s) prob[s] = sum > 0 ? prob[s] / sum : 0.0;
  }

  // Uploads the inputs and points p at them; outputs are pre-filled with 0xFF
  // (NaN in every dtype) so unwritten elements show.
  void upload() {
    const int B = c.B, N = c.N, K = c.K, T = c.T, S = c.S;
    d_q = std::make_unique<DeviceBuffer>(q.bits.data(), q.bits.size());
    d_k = std::make_unique<DeviceBuffer>(k.bits.data(), k.bits.size());
    d_v = std::make_unique<DeviceBuffer>(v.bits.data(), v.bits.size());
    d_do = std::make_unique<DeviceBuffer>(d_o.bits.data(), d_o.bits.size());
    d_lse = std::make_unique<DeviceBuffer>(lse.data(), lse.size() * 4);
    auto q_like = [&](ArrayView& view, void* data) {
      if (c.layout == Layout::kBTNH)
        set_view(view, data, int64_t(T) * N * Hp, int64_t(G) * Hp, Hp, int64_t(N) * Hp, 1);
      else
        set_view(view, data, int64_t(N) * T * Hp, int64_t(G) * T * Hp, int64_t(T) * Hp, Hp, 1);
    };
    auto k_like = [&](ArrayView& view, void* data) {  // g stride 0: GQA
      set_view(view, data, int64_t(S) * K * Hp, Hp, 0, int64_t(K) * Hp, 1);
    };
    q_like(p.q, d_q->ptr), q_like(p.d_o, d_do->ptr);
    k_like(p.k, d_k->ptr), k_like(p.v, d_v->ptr);
    set_view(p.lse, d_lse->ptr, int64_t(N) * T * 2, int64_t(G) * T * 2, int64_t(T) * 2, 2, 1);
    d_delta = std::make_unique<DeviceBuffer>(delta_in.data(), delta_in.size() * 4);
    set_view(p.delta, d_delta->ptr, int64_t(N) * T, int64_t(G) * T, T, 1, 0);
    auto bias_view = [&](ArrayView& view, void* data) {
      switch (c.bias) {
        case Bias::kHeads: set_view(view, data, 0, int64_t(G) * T * S, int64_t(T) * S, S, 1); break;
        case Bias::kFullF32: set_view(view, data, int64_t(N) * T * S, int64_t(G) * T * S, int64_t(T) * S, S, 1); break;
        case Bias::kRowsF32: set_view(view, data, T, 0, 0, 1, 0); break;
        case Bias::kKeysF32: set_view(view, data, S, 0, 0, 0, 1); break;
        case Bias::kScalarF32: set_view(view, data, 0, 0, 0, 0, 0); break;
        default: break;
      }
    };
    if (bias_n) {
      p.flags |= jaxflash::kHasBias;
      p.bias_dtype = bias.t;
      d_bias = std::make_unique<DeviceBuffer>(bias.bits.data(), bias.bits.size());
      bias_view(p.bias, d_bias->ptr);
    }
    if (c.mask != Mask::kNone) {
      p.flags |= jaxflash::kHasMask;
      d_mask = std::make_unique<DeviceBuffer>(mask.data(), mask.size());
      if (c.mask == Mask::kRandom) set_view(p.mask, d_mask->ptr, int64_t(T) * S, 0, 0, S, 1);
      else set_view(p.mask, d_mask->ptr, 0, 0, 0, 0, 1);
    }
    if (c.lens) {
      p.flags |= jaxflash::kHasQLens | jaxflash::kHasKvLens;
      std::vector<int32_t> both(q_lens);
      both.insert(both.end(), kv_lens.begin(), kv_lens.end());
      d_lens = std::make_unique<DeviceBuffer>(both.data(), both.size() * 4);
      set_view(p.q_lens, d_lens->ptr, 1, 0, 0, 0, 0);
      set_view(p.kv_lens, static_cast<int32_t*>(d_lens->ptr) + B, 1, 0, 0, 0, 0);
    }
    // A traced scale: dq of the scaled query in float32 (params.h), dscale laid out as dk's rows.
    d_dq = std::make_unique<DeviceBuffer>(c.traced_scale ? 4 * q.size() : q.bits.size());
    d_dk = std::make_unique<DeviceBuffer>(k.bits.size());
    d_dv = std::make_unique<DeviceBuffer>(v.bits.size());
    q_like(p.dq, d_dq->ptr);
    k_like(p.dk, d_dk->ptr), k_like(p.dv, d_dv->ptr);
    if (c.traced_scale) {
      p.flags |= jaxflash::kScaleOperand | jaxflash::kHasDscale;
      d_scale = std::make_unique<DeviceBuffer>(&p.scale, 4);  // shared by every instance
      set_view(p.scale_operand, d_scale->ptr, 0, 0, 0, 0, 0);
      d_dscale = std::make_unique<DeviceBuffer>(size_t(B) * S * K * 4);
      set_view(p.dscale, d_dscale->ptr, int64_t(S) * K, 1, 0, K, 0);
      d_centre = std::make_unique<DeviceBuffer>(centre.data(), centre.size() * 4);  // delta's layout
      set_view(p.dscale_centre, d_centre->ptr, int64_t(N) * T, int64_t(G) * T, T, 1, 0);
    }
    if (c.dslope) {  // dalibi: delta's instance axes, a row per key (BNS); its centre as delta
      p.flags |= jaxflash::kHasDalibi;
      d_dalibi = std::make_unique<DeviceBuffer>(size_t(B) * N * S * 4);
      set_view(p.dalibi, d_dalibi->ptr, int64_t(N) * S, int64_t(G) * S, S, 1, 0);
      d_mean_key = std::make_unique<DeviceBuffer>(mean_key.data(), mean_key.size() * 4);
      set_view(p.dalibi_centre, d_mean_key->ptr, int64_t(N) * T, int64_t(G) * T, T, 1, 0);
    }
    if (dbias_n) {
      p.flags |= jaxflash::kHasDbias;
      d_dbias = std::make_unique<DeviceBuffer>(dbias_n * elem_bytes(bias.t));
      bias_view(p.dbias, d_dbias->ptr);
    }
    if (!q_ids.empty()) {  // shared by the heads (stride 0)
      p.flags |= jaxflash::kHasSegmentIds;
      std::vector<int32_t> both(q_ids);
      both.insert(both.end(), kv_ids.begin(), kv_ids.end());
      d_ids = std::make_unique<DeviceBuffer>(both.data(), both.size() * 4);
      set_view(p.q_segment_ids, d_ids->ptr, T, 0, 0, 1, 0);
      set_view(p.kv_segment_ids, static_cast<int32_t*>(d_ids->ptr) + size_t(B) * T, S, 0, 0, 1, 0);
    }
    if (c.alibi) {  // shared by the batch (stride 0)
      p.flags |= jaxflash::kHasAlibi;
      d_slopes = std::make_unique<DeviceBuffer>(slopes.data(), slopes.size() * 4);
      set_view(p.alibi_slopes, d_slopes->ptr, 0, G, 1, 0, 0);
    }
    const int64_t ws = jaxflash::gpu::backward_workspace_bytes(p.num_instances(), T, S, c.H, c.dtype,
                                                               p.has(jaxflash::kHasSegmentIds));
    d_ws = std::make_unique<DeviceBuffer>(size_t(ws) + 8);
    if (c.split_batch) split_batch_axis();
  }

  // Axis 0 (batch) as two axes (B / 2, 2) in every view: the same instances in the same
  // linear order.
  void split_batch_axis() {
    const int64_t inner = c.B / 2;
    for (int d = p.num_inst_dims; d > 0; --d) p.inst_size[d] = p.inst_size[d - 1];
    p.inst_size[0] = 2, p.inst_size[1] = inner;
    for (ArrayView* view : {&p.scale_operand, &p.q, &p.k, &p.v, &p.bias, &p.mask, &p.q_lens, &p.kv_lens, &p.seed,
                            &p.q_segment_ids, &p.kv_segment_ids, &p.alibi_slopes, &p.o, &p.lse, &p.d_o, &p.delta,
                            &p.dq, &p.dk, &p.dv, &p.dbias, &p.dalibi, &p.dscale, &p.dscale_centre,
                            &p.dalibi_centre}) {
      for (int d = p.num_inst_dims; d > 0; --d) view->inst_stride[d] = view->inst_stride[d - 1];
      view->inst_stride[0] = view->inst_stride[1] * inner;
    }
    ++p.num_inst_dims;
  }

  // One backward call on garbage-filled outputs and workspace (the workspace
  // starts 8 bytes into its allocation: any alignment must work).
  void run() {
    for (DeviceBuffer* d : {d_dq.get(), d_dk.get(), d_dv.get(), d_dbias.get(), d_dscale.get(), d_dalibi.get(),
                            d_ws.get()})
      if (d) CHECK_CUDA(cudaMemset(d->ptr, 0xFF, d->bytes));
    CHECK_CUDA(jaxflash::gpu::launch_backward(p, static_cast<char*>(d_ws->ptr) + 8, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
  }
};

struct ErrStat {
  double max_err = 0, max_ref = 0;
  int64_t bad = 0;  // NaN / inf, nonzero where exactly zero is due, or touched padding
  void add(double got, double ref) {
    if (!std::isfinite(got)) {
      ++bad;
      return;
    }
    max_err = std::max(max_err, std::fabs(got - ref));
    max_ref = std::max(max_ref, std::fabs(ref));
  }
  bool ok(double tol) const { return bad == 0 && max_err <= tol * std::max(max_ref, 1e-3) + 1e-5; }
  // kExactF32: fp32 accuracy, 2e-5 of the largest reference value (at least 1).
  // Emulating the kernels' arithmetic on the exact cases' shapes (tensor cores
  // truncating as they do) puts 3xTF32 below 0.25 of this bound and tf32
  // products 11-45x above it for every gradient, so an exact case cannot pass
  // on tf32 arithmetic.
  bool ok_fp32() const { return bad == 0 && max_err <= 2e-5 * std::max(max_ref, 1.0); }
};

bool run_case(const Case& c, std::mt19937& rng) {
  Problem pr(c, rng);
  pr.upload();
  pr.run();
  const int B = c.B, N = c.N, K = c.K, T = c.T, S = c.S, H = c.H, G = pr.G;
  HostArray dq(c.traced_scale ? DType::kF32 : c.dtype, pr.q.size()), dk(c.dtype, pr.k.size()), dv(c.dtype, pr.v.size());
  pr.d_dq->download(dq.bits.data());
  pr.d_dk->download(dk.bits.data());
  pr.d_dv->download(dv.bits.data());
  HostArray dbias(pr.bias.t, std::max<size_t>(pr.dbias_n, 1));
  if (pr.dbias_n) pr.d_dbias->download(dbias.bits.data());
  std::vector<float> dscale(c.traced_scale ? size_t(B) * S * K : 0);
  if (c.traced_scale) pr.d_dscale->download(dscale.data());
  std::vector<float> dalibi(c.dslope ? size_t(B) * N * S : 0);
  if (c.dslope) pr.d_dalibi->download(dalibi.data());
  // The kernel's dq with a traced scale is that of the scaled query: scale it as jaxflash/attention.py does.
  const double dq_factor = c.traced_scale ? pr.p.scale : 1.0;

  // Reference gradients in double.
  std::vector<double> rdq(pr.q.size(), 0.0), rdk(pr.k.size(), 0.0), rdv(pr.v.size(), 0.0);
  std::vector<double> rdbias(pr.dbias_n, 0.0);
  // dscale per kv instance (b, kh): Σ dS·(q·k), and Σ |dS·(q·k)|, the size of the terms it cancels from.
  std::vector<double> rdscale(size_t(B) * K, 0.0), dscale_terms(size_t(B) * K, 0.0);
  // ALiBi: per key row (b, n, s) -Σ_t dS·(|d| - C_t) and the size of its terms Σ_t |dS·(|d| - C_t)|;
  // per query head (b, n) the slope's gradient -Σ dS·|d| and Σ |dS·|d||.
  std::vector<double> rdalibi(c.dslope ? size_t(B) * N * S : 0, 0.0), dalibi_terms(rdalibi.size(), 0.0);
  std::vector<double> rdslope(size_t(B) * N, 0.0), dslope_terms(size_t(B) * N, 0.0);
  std::vector<double> prob(S), ds(S);
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n) {
      const int kh = n / G;
      for (int t = 0; t < T; ++t) {
        double lse_r;
        pr.probabilities(b, n, t, prob, lse_r);
        const double delta = pr.delta_in[pr.row_index(b, n, t)];
        for (int s = 0; s < S; ++s) {
          ds[s] = 0;
          if (prob[s] == 0) continue;
          double dp = 0;
          for (int h = 0; h < H; ++h) dp += pr.d_o.val[pr.q_index(b, n, t, h)] * pr.v.val[pr.kv_index(b, kh, s, h)];
          ds[s] = prob[s] * (dp - delta);  // of the logit (dbias's)
          double cap_slope;
          pr.capped_logit(b, n, t, s, &cap_slope);
          const double ds_qk = pr.p.scale * cap_slope * ds[s];  // of q.k
          if (c.traced_scale) {  // dscale = Σ dS_qk·(q·k) / scale: the logit's slope in the scale
            double qk = 0;
            for (int h = 0; h < H; ++h) qk += pr.q.val[pr.q_index(b, n, t, h)] * pr.k.val[pr.kv_index(b, kh, s, h)];
            rdscale[size_t(b) * K + kh] += cap_slope * ds[s] * qk;
            dscale_terms[size_t(b) * K + kh] += std::fabs(cap_slope * ds[s] * qk);
          }
          for (int h = 0; h < H; ++h) {
            rdq[pr.q_index(b, n, t, h)] += ds_qk * pr.k.val[pr.kv_index(b, kh, s, h)];
            rdk[pr.kv_index(b, kh, s, h)] += ds_qk * pr.q.val[pr.q_index(b, n, t, h)];
            rdv[pr.kv_index(b, kh, s, h)] += prob[s] * pr.d_o.val[pr.q_index(b, n, t, h)];
          }
          if (pr.dbias_n) rdbias[pr.bias_index(b, n, t, s)] += ds[s];
          if (c.dslope) {  // dS of the logit, as dbias takes it (ALiBi is added after the cap)
            const double distance = std::fabs(double(s - t - pr.bounds(b).offset));
            const double centred = ds[s] * (distance - pr.alibi_centre(b, n, t));
            rdalibi[pr.dalibi_index(b, n, s)] -= centred;
            dalibi_terms[pr.dalibi_index(b, n, s)] += std::fabs(centred);
            rdslope[size_t(b) * N + n] -= ds[s] * distance;
            dslope_terms[size_t(b) * N + n] += std::fabs(ds[s] * distance);
          }
        }
      }
    }

  // Compare. Padding columns must still hold the 0xFF sentinel; rows past
  // q_len (dq) and keys past kv_len (dk, dv) must be exactly 0.
  ErrStat e_dq, e_dk, e_dv, e_db;
  int64_t bad_pad = 0, bad_zero = 0;
  auto sentinel = [&](const HostArray& a, size_t i) {
    for (int byte = 0; byte < elem_bytes(a.t); ++byte)
      if (a.bits[i * elem_bytes(a.t) + byte] != 0xFF) return false;
    return true;
  };
  for (int b = 0; b < B; ++b) {
    const jaxflash::InstanceBounds hb = pr.bounds(b);
    for (int n = 0; n < N; ++n)
      for (int t = 0; t < T; ++t) {
        for (int h = 0; h < H; ++h) {
          const size_t i = pr.q_index(b, n, t, h);
          e_dq.add(dq_factor * dq.get(i), rdq[i]);
          if (t >= hb.q_len && dq.get(i) != 0) ++bad_zero;
        }
        for (int h = H; h < pr.Hp; ++h) bad_pad += !sentinel(dq, pr.q_index(b, n, t, h));
      }
    for (int kh = 0; kh < K; ++kh)
      for (int s = 0; s < S; ++s) {
        for (int h = 0; h < H; ++h) {
          const size_t i = pr.kv_index(b, kh, s, h);
          e_dk.add(dk.get(i), rdk[i]);
          e_dv.add(dv.get(i), rdv[i]);
          if (s >= hb.kv_len && (dk.get(i) != 0 || dv.get(i) != 0)) ++bad_zero;
        }
        for (int h = H; h < pr.Hp; ++h)
          bad_pad += !sentinel(dk, pr.kv_index(b, kh, s, h)) + !sentinel(dv, pr.kv_index(b, kh, s, h));
      }
  }
  for (size_t i = 0; i < pr.dbias_n; ++i) e_db.add(dbias.get(i), rdbias[i]);
  // dscale: only its sum over the rows is defined (params.h); every row must be written (finite). Its
  // error is held to the size of the terms the sum cancels from: from float32 dS, float32 accuracy
  // (tf32's products: their rounding of q·k). The kernel sums dS·(q·k - E) (dscale_centre); each
  // row of dS sums to dlse, so Σ E·dlse over the group's rows is added back, as
  // jaxflash/attention.py does, and the raw Σ dS·(q·k) is what is checked.
  double dscale_err = 0;
  int64_t dscale_bad = 0;
  for (int b = 0; c.traced_scale && b < B; ++b)
    for (int kh = 0; kh < K; ++kh) {
      double sum = 0;
      for (int s = 0; s < S; ++s) {
        const float x = dscale[pr.dscale_index(b, kh, s)];
        dscale_bad += !std::isfinite(x);
        sum += x;
      }
      for (int g = 0; g < pr.G; ++g)
        for (int t = 0; t < c.T; ++t) {
          const size_t row = pr.row_index(b, kh * pr.G + g, t);
          sum += double(pr.centre[row]) * pr.dlse[row];
        }
      const size_t i = size_t(b) * K + kh;
      dscale_err = std::max(dscale_err, std::fabs(sum - rdscale[i]) / std::max(dscale_terms[i], 1e-3));
    }
  const double dscale_tol = c.dtype == DType::kF32 && !c.exact ? 2e-3 : 1e-4;
  // dalibi: every element written (finite: the outputs start as NaN), each key row's value against
  // the reference's with the same centre, held to the size of the terms it sums (fewer terms than
  // dscale's sum, so a looser bar: it is there to catch a row, head or centre mixed up, which is off
  // by the terms' size); and per query head the rows' sum plus Σ C·dlse over the rows that see a key
  // (what jaxflash/attention.py adds back) against -Σ dS·|d|, the slope's gradient, at dscale's bar.
  const double dalibi_row_tol = c.dtype == DType::kF32 && !c.exact ? 2e-2 : 1e-3;
  double dalibi_err = 0, dslope_err = 0;
  int64_t dalibi_bad = 0;
  for (int b = 0; c.dslope && b < B; ++b)
    for (int n = 0; n < N; ++n) {
      double sum = 0;
      for (int s = 0; s < S; ++s) {
        const size_t i = pr.dalibi_index(b, n, s);
        dalibi_bad += !std::isfinite(dalibi[i]);
        sum += dalibi[i];
        dalibi_err = std::max(dalibi_err, std::fabs(dalibi[i] - rdalibi[i]) / std::max(dalibi_terms[i], 1e-3));
      }
      for (int t = 0; t < T; ++t)
        if (!std::isinf(pr.lse[2 * pr.row_index(b, n, t)]))  // a row that sees a key
          sum -= double(pr.alibi_centre(b, n, t)) * pr.dlse[pr.row_index(b, n, t)];
      const size_t i = size_t(b) * N + n;
      dslope_err = std::max(dslope_err, std::fabs(sum - rdslope[i]) / std::max(dslope_terms[i], 1e-3));
    }

  const double tol = c.dtype == DType::kBF16 ? 3e-2 : 1e-2;
  auto close = [&](const ErrStat& e) { return c.exact ? e.ok_fp32() : e.ok(tol); };
  const bool ok = close(e_dq) && close(e_dk) && close(e_dv) && (pr.dbias_n == 0 || close(e_db)) && bad_pad == 0 &&
                  bad_zero == 0 && dscale_bad == 0 && dscale_err <= dscale_tol && dalibi_bad == 0 &&
                  dalibi_err <= dalibi_row_tol && dslope_err <= dscale_tol;
  std::printf("%-4s %-58s rel err dq %.1e dk %.1e dv %.1e", ok ? "PASS" : "FAIL", c.name.c_str(),
              e_dq.max_err / std::max(e_dq.max_ref, 1e-3), e_dk.max_err / std::max(e_dk.max_ref, 1e-3),
              e_dv.max_err / std::max(e_dv.max_ref, 1e-3));
  if (pr.dbias_n) std::printf(" dbias %.1e", e_db.max_err / std::max(e_db.max_ref, 1e-3));
  if (c.traced_scale) std::printf(" dscale %.1e of its terms (tol %.0e)", dscale_err, dscale_tol);
  if (c.dslope)
    std::printf(" dalibi rows %.1e (tol %.0e), dslope %.1e (tol %.0e) of their terms", dalibi_err, dalibi_row_tol,
                dslope_err, dscale_tol);
  if (c.exact)
    std::printf(" (tol 2e-05 x max(1, max|ref|))");
  else
    std::printf(" (tol %.0e)", tol);
  const int64_t bad = e_dq.bad + e_dk.bad + e_dv.bad + e_db.bad + dscale_bad + dalibi_bad;
  if (bad || bad_pad || bad_zero)
    std::printf("  non-finite %lld, pad writes %lld, nonzero-where-zero %lld", (long long)bad, (long long)bad_pad,
                (long long)bad_zero);
  std::printf("\n");
  return ok;
}

// Runs a case `repeats` times and compares dq, dk, dv, dbias, dscale, dalibi bit for bit.
bool run_determinism(const Case& c, int repeats, std::mt19937& rng) {
  Problem pr(c, rng);
  pr.upload();
  std::vector<std::vector<uint8_t>> first;
  bool same = true;
  for (int rep = 0; rep < repeats && same; ++rep) {
    pr.run();
    std::vector<std::vector<uint8_t>> outs;
    for (DeviceBuffer* d :
         {pr.d_dq.get(), pr.d_dk.get(), pr.d_dv.get(), pr.d_dbias.get(), pr.d_dscale.get(), pr.d_dalibi.get()}) {
      if (!d) continue;
      outs.emplace_back(d->bytes);
      d->download(outs.back().data());
    }
    if (rep == 0) first = std::move(outs);
    else
      for (size_t i = 0; i < outs.size(); ++i) same = same && outs[i] == first[i];
  }
  std::printf("%-4s determinism x%d: %s\n", same ? "PASS" : "FAIL", repeats, c.name.c_str());
  return same;
}

#ifdef JAXFLASH_BWD_TIMELINE
// Where the last launch's CTAs spent their second items (timeline.h), in us per item: the
// phases between consumer 0's events, and the dQ writer's drain after the dK / dV stores
// were issued (negative: done before).
void timeline_report() {
  using namespace jaxflash::gpu;
  std::vector<unsigned long long> t(size_t(kTlCtas) * kTlEvents);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(t.data(), bwd_timeline_buffer(), t.size() * sizeof(t[0]), cudaMemcpyDeviceToHost));
  auto at = [&](int c, int e) { return double(t[size_t(c) * kTlEvents + e]); };
  constexpr int kPhases = 5;
  const int phases[kPhases + 1] = {kTlStart, kTlKvIssue, kTlKvLoaded, kTlFirstQ, kTlLoopDone, kTlEpiStored};
  const char* names[kPhases] = {"setup", "K/V wait", "first Q wait", "Q-tile loop", "dK/dV stores"};
  double sum[kPhases] = {}, drain = 0, life = 0, spin = 0, add = 0, tiles = 0;
  int n = 0;
  for (int c = 0; c < kTlCtas; ++c) {
    // (CTAs with one item, or whose item's keys no query sees, stamp less.)
    if (at(c, kTlStart) == 0 || at(c, kTlFirstQ) == 0 || at(c, kTlEpiStored) == 0) continue;
    ++n;
    for (int k = 0; k < kPhases; ++k) sum[k] += at(c, phases[k + 1]) - at(c, phases[k]);
    drain += at(c, kTlWriterDone) - at(c, kTlEpiStored);
    spin += at(c, kTlWriterSpin), add += at(c, kTlWriterAdd), tiles += at(c, kTlWriterTiles);
    life += std::max(at(c, kTlEpiStored), at(c, kTlWriterDone)) - at(c, kTlStart);
  }
  if (n == 0) return;  // not the sm_90 kernel, or one item per CTA
  std::printf("    timeline: item %d of %d CTAs, us: %.2f =", int(kTlItem), n, life / n / 1e3);
  for (int k = 0; k < kPhases; ++k) std::printf("%s %s %.2f", k ? " +" : "", names[k], sum[k] / n / 1e3);
  std::printf(" + writer drain %.2f\n", drain / n / 1e3);
  if (tiles > 0)
    std::printf("    dQ writer, per tile: %.0f tiles per item, turn wait %.2f us, reduction to release %.2f us\n",
                tiles / n, spin / tiles / 1e3, add / tiles / 1e3);
}
#endif

void bench(const BenchFilter& only) {
  std::printf("\nbf16 backward, batch x seqlen = 16384 tokens, hidden 2048 (FlashAttention's protocol)\n");
  for (int H : {64, 128})
    for (bool causal : {false, true})
      for (int L : {1024, 4096, 16384}) {
        if (only.skips(H, L, causal)) continue;
        // Rows of L tokens, or (only.packed) those rows packed into one with segment ids.
        const int B = only.packed ? 1 : 16384 / L, T = only.packed ? 16384 : L, N = 2048 / H;
        const size_t n = size_t(B) * T * N * H;
        DeviceBuffer q(2 * n), k(2 * n), v(2 * n), d_o(2 * n), dq(2 * n), dk(2 * n), dv(2 * n);
        DeviceBuffer lse(2 * 4 * size_t(B) * N * T), delta(4 * size_t(B) * N * T);
        CHECK_CUDA(cudaMemset(delta.ptr, 0, 4 * size_t(B) * N * T));
        std::vector<__nv_bfloat16> host(n);
        std::mt19937 rng(1);
        std::uniform_real_distribution<float> uni(-1.f, 1.f);
        for (auto& x : host) x = __float2bfloat16_rn(uni(rng));
        for (void* dst : {q.ptr, k.ptr, v.ptr, d_o.ptr})
          CHECK_CUDA(cudaMemcpy(dst, host.data(), 2 * n, cudaMemcpyHostToDevice));
        std::vector<float> lse_host(2 * size_t(B) * N * T, 0.f);  // (hi, lo) = (log2 L, 0)
        for (size_t i = 0; i < lse_host.size(); i += 2) lse_host[i] = std::log2(float(L));
        CHECK_CUDA(cudaMemcpy(lse.ptr, lse_host.data(), lse_host.size() * 4, cudaMemcpyHostToDevice));
        AttentionParams p;
        p.dtype = DType::kBF16;
        p.num_inst_dims = 2;
        p.inst_size[0] = B, p.inst_size[1] = N;
        p.seqlen_q = p.seqlen_k = T, p.head_dim = H;
        p.scale = 1.f / std::sqrt(float(H));
        if (causal) p.window_right = 0;
        for (ArrayView* view : {&p.q, &p.k, &p.v, &p.d_o, &p.dq, &p.dk, &p.dv}) {
          view->inst_stride[0] = int64_t(T) * N * H, view->inst_stride[1] = H;
          view->row_stride = int64_t(N) * H, view->col_stride = 1;
        }
        p.q.data = q.ptr, p.k.data = k.ptr, p.v.data = v.ptr, p.d_o.data = d_o.ptr;
        p.dq.data = dq.ptr, p.dk.data = dk.ptr, p.dv.data = dv.ptr;
        set_view(p.lse, lse.ptr, int64_t(N) * T * 2, int64_t(T) * 2, 0, 2, 1);
        set_view(p.delta, delta.ptr, int64_t(N) * T, T, 0, 1, 0);
        DeviceBuffer ids(only.packed ? 4 * size_t(T) : 0);
        if (only.packed) set_packed_ids(p, ids, T, L);
        DeviceBuffer ws(jaxflash::gpu::backward_workspace_bytes(p.num_instances(), T, T, H, p.dtype, only.packed));
        cudaEvent_t start, stop;
        CHECK_CUDA(cudaEventCreate(&start));
        CHECK_CUDA(cudaEventCreate(&stop));
        for (int i = 0; i < 3; ++i) CHECK_CUDA(jaxflash::gpu::launch_backward(p, ws.ptr, nullptr));
        const int iters = 10;
        CHECK_CUDA(cudaEventRecord(start));
        for (int i = 0; i < iters; ++i) CHECK_CUDA(jaxflash::gpu::launch_backward(p, ws.ptr, nullptr));
        CHECK_CUDA(cudaEventRecord(stop));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        ms /= iters;
        // 2.5x the forward (packed: the same work)
        const double flops = 10.0 * (16384 / L) * N * double(L) * L * H / (causal ? 2 : 1);
        std::printf("  H=%3d %-6s N=%5d%s  %8.3f ms  %6.1f TFLOP/s\n", H, causal ? "causal" : "", L,
                    only.packed ? " packed" : "", ms, flops / ms / 1e9);
#ifdef JAXFLASH_BWD_TIMELINE
        CHECK_CUDA(jaxflash::gpu::launch_backward(p, ws.ptr, nullptr));  // alone: its CTAs' stamps
        timeline_report();
#endif
        CHECK_CUDA(cudaEventDestroy(start));
        CHECK_CUDA(cudaEventDestroy(stop));
      }
}

}  // namespace

int main(int argc, char** argv) {
  if (BenchFilter only; bench_only(argc, argv, &only)) {
    bench(only);
    return 0;
  }
  const DType f16 = DType::kF16, bf16 = DType::kBF16, f32 = DType::kF32;
  // name, dtype, B, N, K, T, S, H, window_left, window_right, bottom_right, bias, dbias, mask, lens, dlse, layout
  std::vector<Case> cases = {
      {"bf16 causal T113 S203 H64", bf16, 2, 3, 3, 113, 203, 64, kUnb, 0},
      {"f16 causal T113 S203 H64", f16, 2, 3, 3, 113, 203, 64, kUnb, 0},
      {"f32 causal T113 S203 H64", f32, 2, 3, 3, 113, 203, 64, kUnb, 0},
      {"bf16 T1 S37 H128", bf16, 2, 2, 2, 1, 37, 128},
      {"f16 T1 S37 H128 causal bottom-right", f16, 2, 2, 2, 1, 37, 128, kUnb, 0, true},
      {"bf16 GQA N8 K2 T77 S150 H128", bf16, 2, 8, 2, 77, 150, 128},
      {"f16 MQA N4 K1 causal T130 S130 H64 + dlse", f16, 1, 4, 1, 130, 130, 64, kUnb, 0, false, Bias::kNone, false,
       Mask::kNone, false, true},
      {"bf16 window (10, 3) T150 S150 H96", bf16, 1, 2, 2, 150, 150, 96, 10, 3},
      {"f16 window left 40 only T300 S260 H32", f16, 1, 2, 1, 300, 260, 32, 40, kUnb},
      {"bf16 lens (kv_len 0, short q) bottom-right causal T90 S120 H64", bf16, 3, 2, 1, 90, 120, 64, kUnb, 0, true,
       Bias::kNone, false, Mask::kNone, true},
      {"f16 lens + window (8, 8) T64 S64 H128", f16, 3, 2, 2, 64, 64, 128, 8, 8, false, Bias::kNone, false,
       Mask::kNone, true},
      {"bf16 bias (N,T,S) over batch + dbias T70 S90 H64", bf16, 3, 4, 2, 70, 90, 64, kUnb, kUnb, false,
       Bias::kHeads, true},
      {"f16 bias f32 (B,N,T,S) + dbias causal T100 S140 H64", f16, 2, 2, 2, 100, 140, 64, kUnb, 0, false,
       Bias::kFullF32, true},
      {"bf16 bias f32 (B,T) cols bcast + dbias GQA T70 S90 H64", bf16, 2, 4, 2, 70, 90, 64, kUnb, kUnb, false,
       Bias::kRowsF32, true},
      {"f16 bias f32 (B,S) rows bcast + dbias + lens T80 S100 H32", f16, 3, 2, 1, 80, 100, 32, kUnb, kUnb, false,
       Bias::kKeysF32, true, Mask::kNone, true},
      {"bf16 bias f32 scalar + dbias T40 S50 H64", bf16, 2, 2, 2, 40, 50, 64, kUnb, 0, false, Bias::kScalarF32, true},
      {"bf16 mask (B,T,S) + fully masked row T129 S140 H128", bf16, 2, 2, 2, 129, 140, 128, kUnb, kUnb, false,
       Bias::kNone, false, Mask::kRandom},
      {"f16 key-padding mask (S) causal + bias dtype + dbias T100 S100 H64", f16, 2, 2, 2, 100, 100, 64, kUnb, 0,
       false, Bias::kHeads, true, Mask::kKeyPadding},
      {"bf16 unaligned H59 lens causal T90 S120", bf16, 3, 2, 1, 90, 120, 59, kUnb, 0, true, Bias::kNone, false,
       Mask::kNone, true},
      {"f16 BNTH T130 S257 H200 (D256)", f16, 1, 2, 2, 130, 257, 200, kUnb, kUnb, false, Bias::kNone, false,
       Mask::kNone, false, false, Layout::kBNTH},
      {"bf16 causal T64 S129 H160 (D192)", bf16, 2, 2, 1, 64, 129, 160, kUnb, 0},
      {"f16 T300 S200 H96 scale 0.5 + dlse", f16, 1, 2, 2, 300, 200, 96, kUnb, kUnb, false, Bias::kNone, false,
       Mask::kNone, false, true, Layout::kBTNH, 0.5f},
      {"f32 T77 S130 H72 causal GQA", f32, 2, 4, 2, 77, 130, 72, kUnb, 0},
      {"f32 T40 S70 H256", f32, 1, 2, 2, 40, 70, 256},
      {"f32 T50 S100 H192 lens", f32, 3, 2, 2, 50, 100, 192, kUnb, kUnb, false, Bias::kNone, false, Mask::kNone, true},
      {"f32 T65 S33 H32 mask + bias f32 + dbias", f32, 2, 2, 2, 65, 33, 32, kUnb, kUnb, false, Bias::kFullF32, true,
       Mask::kRandom},
      {"f32 T128 S128 H128 window (3, 0)", f32, 1, 2, 2, 128, 128, 128, 3, 0},
      {"bf16 T1 S1 H16", bf16, 1, 1, 1, 1, 1, 16},
      {"bf16 GQA causal lens + dlse T100 S150 H128", bf16, 3, 4, 2, 100, 150, 128, kUnb, 0, false,
       Bias::kNone, false, Mask::kNone, true, true, Layout::kBTNH, 0.f},
      {"f16 bias (N,T,S) + dbias + mask T90 S70 H64", f16, 2, 2, 2, 90, 70, 64, kUnb, kUnb, false,
       Bias::kHeads, true, Mask::kRandom, false, false, Layout::kBTNH, 0.f},
      {"f32 T60 S80 H96", f32, 1, 2, 1, 60, 80, 96, kUnb, kUnb, false, Bias::kNone, false,
       Mask::kNone, false, false, Layout::kBTNH, 0.f},
      // kExactF32: fast and general variants, head dims 64 / 72 / 128 / 256
      // (and 32 / 192), odd shapes, causal, GQA, bias + dbias, mask, lengths, dlse.
      exact({"f32 causal T113 S203 H64", f32, 2, 3, 3, 113, 203, 64, kUnb, 0}),
      exact({"f32 T77 S130 H72 causal GQA", f32, 2, 4, 2, 77, 130, 72, kUnb, 0}),
      exact({"f32 T128 S128 H128", f32, 1, 2, 2, 128, 128, 128}),
      exact({"f32 T40 S70 H256", f32, 1, 2, 2, 40, 70, 256}),
      exact({"f32 T65 S33 H32 mask + bias f32 + dbias", f32, 2, 2, 2, 65, 33, 32, kUnb, kUnb, false,
             Bias::kFullF32, true, Mask::kRandom}),
      exact({"f32 bias (N,T,S) over batch + dbias causal T70 S90 H64", f32, 3, 4, 2, 70, 90, 64, kUnb, 0, false,
             Bias::kHeads, true}),
      exact({"f32 MQA N4 K1 causal T130 S130 H64 + dlse", f32, 1, 4, 1, 130, 130, 64, kUnb, 0, false, Bias::kNone,
             false, Mask::kNone, false, true}),
      exact({"f32 T50 S100 H192 lens", f32, 3, 2, 2, 50, 100, 192, kUnb, kUnb, false, Bias::kNone, false,
             Mask::kNone, true}),
      // Segment ids (the general variants): documents in order (tiles skipped, dQ turns only
      // for the key tiles that meet; batch 1 ending in padding ids), documents on tile
      // boundaries, ids in any order; causal, GQA, lengths, dbias.
      with_segments({"bf16 segments docs T300 S300 H64", bf16, 2, 2, 2, 300, 300, 64}, Segments::kDocs),
      with_segments({"f16 segments docs causal GQA N4 K2 T257 S257 H128", f16, 2, 4, 2, 257, 257, 128, kUnb, 0},
                    Segments::kDocs),
      with_segments({"bf16 segments tile docs causal T384 S384 H64", bf16, 2, 2, 1, 384, 384, 64, kUnb, 0},
                    Segments::kTileDocs),
      with_segments({"f16 segments tile docs T320 S448 H128", f16, 2, 2, 2, 320, 448, 128}, Segments::kTileDocs),
      with_segments({"bf16 segments docs + lens bottom-right causal T200 S333 H64", bf16, 3, 2, 1, 200, 333, 64,
                     kUnb, 0, true, Bias::kNone, false, Mask::kNone, true},
                    Segments::kDocs),
      with_segments({"f16 segments random ids + mask T129 S140 H96", f16, 2, 2, 2, 129, 140, 96, kUnb, kUnb, false,
                     Bias::kNone, false, Mask::kRandom},
                    Segments::kRandom),
      with_segments({"bf16 segments docs + bias f32 (B,N,T,S) + dbias causal T200 S260 H64", bf16, 2, 2, 2, 200,
                     260, 64, kUnb, 0, false, Bias::kFullF32, true},
                    Segments::kDocs),
      with_segments({"f16 segments tile docs + bias (B,S) rows bcast + dbias T256 S320 H32", f16, 2, 2, 1, 256, 320,
                     32, kUnb, kUnb, false, Bias::kKeysF32, true},
                    Segments::kTileDocs),
      with_segments({"f32 segments docs causal GQA T200 S200 H72", f32, 2, 4, 2, 200, 200, 72, kUnb, 0},
                    Segments::kDocs),
      with_segments(exact({"f32 segments tile docs T256 S320 H128", f32, 2, 2, 2, 256, 320, 128}),
                    Segments::kTileDocs),
      // Segment ids with ids in any order (the element test everywhere, no tile skipped), at
      // the head dims of the sm_90 kernel.
      with_segments({"bf16 segments random ids causal T200 S260 H128", bf16, 2, 2, 1, 200, 260, 128, kUnb, 0},
                    Segments::kRandom),
      with_segments({"f16 segments random ids GQA N4 K2 T150 S190 H64", f16, 2, 4, 2, 150, 190, 64},
                    Segments::kRandom),
      // The soft-cap and ALiBi, alone, together and with segment ids: on Hopper the 16-bit
      // D = 64 / 128 cases run the sm_90 kernel's copy for them (its transposed fragments:
      // tails, causal / window / bottom-right diagonals, GQA, lengths), the others (float32,
      // a mask, D = 96) the mma.sync general kernel.
      with_softcap({"bf16 softcap 2 T200 S300 H64", bf16, 2, 2, 2, 200, 300, 64}, 2.f),
      with_softcap({"f16 softcap 1.5 causal GQA N4 K2 T257 S257 H128", f16, 2, 4, 2, 257, 257, 128, kUnb, 0}, 1.5f),
      with_softcap({"bf16 softcap 5 scale 1 T130 S190 H128", bf16, 1, 2, 2, 130, 190, 128, kUnb, kUnb, false,
                    Bias::kNone, false, Mask::kNone, false, false, Layout::kBTNH, 1.f},
                   5.f),
      with_alibi({"bf16 alibi causal T150 S230 H128", bf16, 2, 2, 2, 150, 230, 128, kUnb, 0}),
      with_alibi({"f16 alibi T113 S203 H64", f16, 2, 3, 3, 113, 203, 64}),
      with_alibi({"bf16 alibi lens bottom-right window (40, 8) T180 S260 H64", bf16, 3, 2, 1, 180, 260, 64, 40, 8,
                  true, Bias::kNone, false, Mask::kNone, true}),
      with_alibi({"f16 alibi lens bottom-right causal GQA N4 K2 T90 S140 H128", f16, 3, 4, 2, 90, 140, 128, kUnb, 0,
                  true, Bias::kNone, false, Mask::kNone, true}),
      with_alibi(with_softcap({"f16 alibi + softcap 2 T160 S160 H64 + dlse", f16, 1, 2, 2, 160, 160, 64, kUnb, kUnb,
                               false, Bias::kNone, false, Mask::kNone, false, true},
                              2.f)),
      with_alibi(with_softcap(with_segments({"bf16 alibi + softcap 3 + segments docs causal GQA N4 K2 T300 S300 H128",
                                             bf16, 2, 4, 2, 300, 300, 128, kUnb, 0},
                                            Segments::kDocs),
                              3.f)),
      with_softcap(with_segments({"f16 softcap 2.5 + segments docs + lens T257 S300 H64", f16, 3, 2, 1, 257, 300, 64,
                                  kUnb, kUnb, false, Bias::kNone, false, Mask::kNone, true},
                                 Segments::kDocs),
                   2.5f),
      with_alibi(with_segments({"f16 alibi + segments tile docs T320 S448 H128", f16, 2, 2, 2, 320, 448, 128},
                               Segments::kTileDocs)),
      with_alibi(with_segments({"bf16 alibi + segments random ids T129 S200 H64", bf16, 2, 2, 2, 129, 200, 64},
                               Segments::kRandom)),
      with_alibi(with_softcap({"bf16 alibi + softcap 2 + mask T129 S140 H64", bf16, 2, 2, 2, 129, 140, 64, kUnb, kUnb,
                               false, Bias::kNone, false, Mask::kRandom},
                              2.f)),
      with_alibi(with_softcap({"f16 alibi + softcap 2 causal T100 S150 H96", f16, 2, 2, 1, 100, 150, 96, kUnb, 0},
                              2.f)),
      with_alibi(with_softcap({"f32 alibi + softcap 2 causal GQA T100 S150 H64", f32, 2, 4, 2, 100, 150, 64, kUnb, 0},
                              2.f)),
      // The sm_90 backward's TMA loads: rows past the lengths hold NaN (its consumers zero Q /
      // dO rows in [q_len, T) of the last tile, the TMA zero-fills rows past T), T not a
      // multiple of the tile, GQA groups of several Q tiles, key tiles that see no query
      // (causal, kv_len 0), windows and both alignments, the dropout-free copies on their
      // producer's walk (segment ids: its skipping; ALiBi / soft-cap: the score-mods copy);
      // then four instance axes, which no descriptor holds: the mma.sync fallback.
      nan_padded({"bf16 lens GQA N4 K2 causal T200 S230 H64", bf16, 3, 4, 2, 200, 230, 64, kUnb, 0, false, Bias::kNone,
                  false, Mask::kNone, true}),
      nan_padded({"f16 lens window (50, 20) bottom-right T150 S170 H128", f16, 3, 2, 1, 150, 170, 128, 50, 20, true,
                  Bias::kNone, false, Mask::kNone, true}),
      nan_padded({"bf16 lens GQA N8 K2 T77 S300 H128", bf16, 3, 8, 2, 77, 300, 128, kUnb, kUnb, false, Bias::kNone,
                  false, Mask::kNone, true}),
      nan_padded(with_alibi({"f16 alibi lens causal GQA N4 K2 T260 S200 H64", f16, 3, 4, 2, 260, 200, 64, kUnb, 0,
                             false, Bias::kNone, false, Mask::kNone, true})),
      nan_padded(with_segments({"bf16 segments docs lens causal GQA N4 K2 T300 S300 H128", bf16, 3, 4, 2, 300, 300,
                                128, kUnb, 0, false, Bias::kNone, false, Mask::kNone, true},
                               Segments::kDocs)),
      nan_padded({"bf16 lens (batch 1: q_len 0) GQA N4 K2 T6 S100 H64", bf16, 3, 4, 2, 6, 100, 64, kUnb, kUnb, false,
                  Bias::kNone, false, Mask::kNone, true}),
      // Head dims the sm_90 kernel pads (to 64 / 128: bwd_padded_head_dim): the TMA zero-fills
      // the columns past H, and dK / dV must stop at H (the pitch's pad columns and the next
      // head's catch a store of the whole padded row).
      nan_padded({"bf16 lens GQA N4 K2 causal T200 S230 H40", bf16, 3, 4, 2, 200, 230, 40, kUnb, 0, false,
                  Bias::kNone, false, Mask::kNone, true}),
      with_softcap({"bf16 window (30, 10) T160 S140 H120", bf16, 2, 2, 2, 160, 140, 120, 30, 10}, 2.f),
      {"f16 causal T130 S260 H56", f16, 1, 2, 1, 130, 260, 56, kUnb, 0},
      four_axes({"bf16 causal GQA N4 K2 T150 S150 H64", bf16, 4, 4, 2, 150, 150, 64, kUnb, 0}),
      four_axes(nan_padded({"f16 lens T100 S120 H128", f16, 4, 2, 2, 100, 120, 128, kUnb, kUnb, false, Bias::kNone,
                            false, Mask::kNone, true})),
      // A traced scale (the general variants): GQA (dscale summed over the group), lengths with an
      // instance that sees no key, bias + dbias + mask, a window, a negative scale, tf32 and 3xTF32.
      traced({"bf16 GQA N8 K2 causal lens T100 S150 H128", bf16, 3, 8, 2, 100, 150, 128, kUnb, 0, false,
              Bias::kNone, false, Mask::kNone, true}),
      traced({"f16 bias (N,T,S) + dbias + mask + dlse T90 S70 H64 scale -0.3", f16, 2, 2, 2, 90, 70, 64, kUnb, kUnb,
              false, Bias::kHeads, true, Mask::kRandom, false, true, Layout::kBTNH, -0.3f}),
      traced({"f32 window (10, 3) T150 S150 H96", f32, 1, 2, 1, 150, 150, 96, 10, 3}),
      traced(exact({"f32 T77 S130 H72 causal GQA", f32, 2, 4, 2, 77, 130, 72, kUnb, 0})),
      // The soft-cap copy's centre, taken with dS of the logits (dscale_share), and the lse's
      // cotangent that the centre's share is added back for.
      traced(with_softcap({"bf16 softcap 3 + dlse GQA T100 S150 H64", bf16, 2, 4, 2, 100, 150, 64, kUnb, kUnb, false,
                           Bias::kNone, false, Mask::kNone, false, true},
                          3.f)),
      // ALiBi's slope gradient (dalibi, the general variant's copies that run ALiBi, on Hopper
      // too): causal and not, T < S and T > S, GQA (each query head's rows its own), lengths with
      // an instance that sees no key and the bottom-right diagonal (the centre's offset), windows,
      // dlse (the centre's share added back), the soft-cap copy (dS taken before the cap's slope),
      // segment ids (the copy for ids and a soft-cap, cap off or on; instances skipped whole get
      // zeros), the S grid's 8 / 16 / 32 key columns per warp (f32 D = 256 / 96, 16-bit), a bias
      // and a mask, NaN padding, four instance axes and a traced scale alongside.
      dslope({"bf16 causal T150 S230 H128", bf16, 2, 2, 2, 150, 230, 128, kUnb, 0}),
      dslope({"f16 T203 S113 H64 + dlse", f16, 2, 3, 3, 203, 113, 64, kUnb, kUnb, false, Bias::kNone, false,
              Mask::kNone, false, true}),
      dslope({"bf16 lens bottom-right causal GQA N4 K2 T90 S140 H128 + dlse", bf16, 3, 4, 2, 90, 140, 128, kUnb, 0,
              true, Bias::kNone, false, Mask::kNone, true, true}),
      dslope({"f16 lens bottom-right window (40, 8) GQA N2 K1 T260 S180 H64", f16, 3, 2, 1, 260, 180, 64, 40, 8, true,
              Bias::kNone, false, Mask::kNone, true}),
      dslope(with_softcap({"bf16 softcap 2 T160 S160 H64 + dlse", bf16, 1, 2, 2, 160, 160, 64, kUnb, kUnb, false,
                           Bias::kNone, false, Mask::kNone, false, true},
                          2.f)),
      dslope(with_softcap(with_segments({"bf16 softcap 3 + segments docs causal GQA N4 K2 T300 S300 H128", bf16, 2, 4,
                                         2, 300, 300, 128, kUnb, 0},
                                        Segments::kDocs),
                          3.f)),
      dslope(with_segments({"f16 segments tile docs T320 S448 H128", f16, 2, 2, 2, 320, 448, 128},
                           Segments::kTileDocs)),
      dslope({"f32 causal GQA N4 K2 T100 S150 H64", f32, 2, 4, 2, 100, 150, 64, kUnb, 0}),
      dslope(exact({"f32 T77 S130 H72 GQA", f32, 2, 4, 2, 77, 130, 72})),
      dslope({"f32 T40 S70 H256 mask + bias f32 + dbias", f32, 2, 2, 2, 40, 70, 256, kUnb, kUnb, false,
              Bias::kFullF32, true, Mask::kRandom}),
      dslope({"f16 BNTH T130 S257 H200 (D256) causal", f16, 1, 2, 2, 130, 257, 200, kUnb, 0, false, Bias::kNone,
              false, Mask::kNone, false, false, Layout::kBNTH}),
      dslope({"bf16 T1 S37 H128", bf16, 2, 2, 2, 1, 37, 128}),
      dslope({"f16 T37 S1 H32 + dlse", f16, 2, 2, 1, 37, 1, 32, kUnb, kUnb, false, Bias::kNone, false, Mask::kNone,
              false, true}),
      dslope(nan_padded({"f16 lens causal GQA N4 K2 T260 S200 H64", f16, 3, 4, 2, 260, 200, 64, kUnb, 0, false,
                         Bias::kNone, false, Mask::kNone, true})),
      dslope(four_axes({"bf16 causal GQA N4 K2 T150 S150 H64", bf16, 4, 4, 2, 150, 150, 64, kUnb, 0})),
      traced(dslope({"bf16 GQA N8 K2 causal lens T100 S150 H128 + dlse", bf16, 3, 8, 2, 100, 150, 128, kUnb, 0,
                     false, Bias::kNone, false, Mask::kNone, true, true})),
      // More key tiles than an H100 has SMs, twice over: on Hopper each persistent CTA of the sm_90
      // kernel computes several items in turn (K / V reloaded into the same shared memory, the
      // rings' phases running on). GQA with lengths (an instance with no keys: items that load
      // nothing), causal with T < S (key tiles no query sees), segment ids (the copy whose
      // consumers name the dQ turns, an end mark per item). Last in the list, so that the cases
      // before draw the same inputs.
      {"bf16 many key tiles GQA lens N16 K4 T64 S1152 H128", bf16, 12, 16, 4, 64, 1152, 128, kUnb, kUnb, false,
       Bias::kNone, false, Mask::kNone, true},
      {"f16 many key tiles causal T130 S700 H64", f16, 8, 16, 16, 130, 700, 64, kUnb, 0},
      with_segments({"f16 many key tiles segments docs GQA N8 K2 T128 S1024 H128", f16, 16, 8, 2, 128, 1024, 128},
                    Segments::kDocs),
  };
  std::mt19937 rng(1234);
  int passed = 0, failed = 0;
  for (const Case& c : cases) (run_case(c, rng) ? passed : failed)++;

  bool quick = false, want_bench = false;
  for (int i = 1; i < argc; ++i) {
    quick = quick || std::string(argv[i]) == "quick";
    want_bench = want_bench || std::string(argv[i]) == "bench";
  }
  // Determinism: large enough that many CTAs contend for each dQ tile.
  std::vector<Case> det = {
      {"bf16 causal GQA N16 K4 T2048 S2048 H128", bf16, 2, 16, 4, 2048, 2048, 128, kUnb, 0},
      {"f16 T1000 S3000 H64 bias (N,T,S) + dbias", f16, 2, 4, 4, 1000, 3000, 64, kUnb, kUnb, false, Bias::kHeads,
       true},
      {"f32 T777 S999 H96 window (100, 50)", f32, 2, 4, 2, 777, 999, 96, 100, 50},
      exact({"f32 causal GQA N8 K2 T1000 S1000 H128", f32, 1, 8, 2, 1000, 1000, 128, kUnb, 0}),
      // Skipped tiles take no dQ turn: the remaining turns must still be in key order.
      with_segments({"bf16 segments docs causal GQA N8 K2 T1000 S1000 H128", bf16, 2, 8, 2, 1000, 1000, 128, kUnb,
                     0},
                    Segments::kDocs),
      // The same with the score modifiers (on Hopper the sm_90 kernel's copy for them, whose
      // consumers name each dQ turn to its writer).
      with_alibi(with_softcap(with_segments({"f16 alibi + softcap + segments docs causal GQA N8 K2 T1000 S1000 H64",
                                             f16, 2, 8, 2, 1000, 1000, 64, kUnb, 0},
                                            Segments::kDocs),
                              4.f)),
      traced({"bf16 causal GQA N8 K2 T1000 S1000 H128", bf16, 2, 8, 2, 1000, 1000, 128, kUnb, 0}),
      // dalibi's fixed-order sums (lanes, warps, Q tiles, the GQA group's heads).
      dslope({"bf16 causal GQA N8 K2 T1000 S1000 H128", bf16, 2, 8, 2, 1000, 1000, 128, kUnb, 0}),
      // The sm_90 backward at D = 64 (BLOCK_M 128), its producer crossing GQA instances.
      nan_padded({"bf16 lens causal GQA N8 K2 T1500 S1500 H64", bf16, 3, 8, 2, 1500, 1500, 64, kUnb, 0, false,
                  Bias::kNone, false, Mask::kNone, true}),
  };
  if (quick) det.clear();
  for (const Case& c : det) (run_determinism(c, 3, rng) ? passed : failed)++;

  std::printf("%d passed, %d failed\n", passed, failed);
  if (want_bench) bench(BenchFilter{});
  return failed == 0 ? 0 : 1;
}
