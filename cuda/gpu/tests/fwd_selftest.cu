// Standalone check of jaxflash::gpu::launch_forward against a naive double
// precision CPU reference, on small odd shapes that hit every feature: tails,
// causal / window / bottom-right, GQA (zero instance stride), broadcast bias
// and mask, sequence lengths, segment ids (documents, documents on tile
// boundaries, ids in any order), unaligned rows, every padded head dim, f32
// (tf32 MMAs) and f32 with kExactF32 (3xTF32, held to fp32 accuracy).
//
// Build (from the repository root; cmake/cuda.cmake's JAXFLASH_BUILD_SELFTESTS):
//   cmake -S . -B /tmp/selftests -DJAXFLASH_CUDA=ON -DJAXFLASH_CUDA_ARCHITECTURES=90a \
//         -DJAXFLASH_BUILD_SELFTESTS=ON && cmake --build /tmp/selftests --target fwd_selftest
// Run: /tmp/selftests/fwd_selftest          correctness cases, exit status 0 iff all pass
//      /tmp/selftests/fwd_selftest bench    also time bf16 forward at FlashAttention's benchmark shapes
//                                            (and D = 256)
//      /tmp/selftests/fwd_selftest bench-only [D N causal|full [packed]]   time only (one shape), no checks
//                                                     (packed: its rows in one row, with segment ids)
//      /tmp/selftests/fwd_selftest WORD     only the cases whose name contains WORD (e.g. under compute-sanitizer)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../forward.h"
#include "../timeline.h"
#include "selftest_util.h"

namespace {

enum class Bias { kNone, kF32QueryKey, kDtypeHeads, kF32RowOnly };  // (T,S) f32 | (N,T,S) dtype | (B,T) f32, col stride 0
enum class Mask { kNone, kRandom, kKeyPadding };                    // (B,T,S) + a fully masked row | (S) broadcast
enum class Layout { kBTNH, kBNTH };                                 // q and o; k, v are always BSKH

struct Case {
  std::string name;
  DType dtype;
  int B, N, K, T, S, H;
  int64_t window_left = kUnb, window_right = kUnb;
  bool bottom_right = false;
  Bias bias = Bias::kNone;
  Mask mask = Mask::kNone;
  bool lens = false;
  Layout layout = Layout::kBTNH;
  float scale = 0.f;     // 0: 1 / sqrt(H)
  bool out_f32 = false;  // kOutputF32: o in float32 whatever the dtype
  bool exact = false;    // kExactF32 (float32 only): 3xTF32 MMAs, fp32-accurate
  Segments segments = Segments::kNone;
  float softcap = 0.f;  // logits_soft_cap; 0: none
  bool alibi = false;   // ALiBi: a slope per query head
};

Case exact(Case c) { return exact_variant(c); }
Case with_segments(Case c, Segments s) { return segments_variant(c, s); }
Case with_softcap(Case c, float cap) { return softcap_variant(c, cap); }
Case with_alibi(Case c) { return alibi_variant(c); }

bool run_case(const Case& c, std::mt19937& rng) {
  const int B = c.B, N = c.N, K = c.K, G = N / K, T = c.T, S = c.S, H = c.H;
  const int Hp = H + 8;  // o's per-head pitch: the 8 extra columns must stay untouched
  std::uniform_real_distribution<float> uni(-1.f, 1.f);

  HostArray q(c.dtype, size_t(B) * T * N * H), k(c.dtype, size_t(B) * S * K * H), v(c.dtype, size_t(B) * S * K * H);
  for (size_t i = 0; i < q.val.size(); ++i) q.set(i, 2.f * uni(rng));
  for (size_t i = 0; i < k.val.size(); ++i) k.set(i, 2.f * uni(rng));
  for (size_t i = 0; i < v.val.size(); ++i) v.set(i, uni(rng));

  AttentionParams p;
  p.dtype = c.dtype;
  p.num_inst_dims = 3;
  p.inst_size[0] = B, p.inst_size[1] = K, p.inst_size[2] = G;  // head n = kh * G + g
  p.seqlen_q = T, p.seqlen_k = S, p.head_dim = H;
  p.scale = c.scale != 0.f ? c.scale : 1.f / std::sqrt(float(H));
  p.window_left = c.window_left, p.window_right = c.window_right;
  p.softcap = c.softcap;
  if (c.bottom_right) p.flags |= jaxflash::kBottomRight;
  if (c.exact) p.flags |= jaxflash::kExactF32;

  DeviceBuffer dq(q.bits.size()), dk(k.bits.size()), dv(v.bits.size());
  CHECK_CUDA(cudaMemcpy(dq.ptr, q.bits.data(), q.bits.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk.ptr, k.bits.data(), k.bits.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv.ptr, v.bits.data(), v.bits.size(), cudaMemcpyHostToDevice));
  // q: BTNH or BNTH; k, v: BSKH (g stride 0: GQA).
  if (c.layout == Layout::kBTNH)
    set_view(p.q, dq.ptr, int64_t(T) * N * H, int64_t(G) * H, H, int64_t(N) * H, 1);
  else
    set_view(p.q, dq.ptr, int64_t(N) * T * H, int64_t(G) * T * H, int64_t(T) * H, H, 1);
  set_view(p.k, dk.ptr, int64_t(S) * K * H, H, 0, int64_t(K) * H, 1);
  set_view(p.v, dv.ptr, int64_t(S) * K * H, H, 0, int64_t(K) * H, 1);
  auto q_index = [&](int b, int n, int t, int h) -> size_t {
    return c.layout == Layout::kBTNH ? ((size_t(b) * T + t) * N + n) * H + h : ((size_t(b) * N + n) * T + t) * H + h;
  };
  auto kv_index = [&](int b, int kh, int s, int h) -> size_t { return ((size_t(b) * S + s) * K + kh) * H + h; };

  // Output o with pitch Hp per head (BTNH or BNTH), pre-filled with a NaN sentinel; lse BNT
  // with its two floats (hi, lo: params.h) innermost.
  const DType out_t = c.out_f32 ? DType::kF32 : c.dtype;
  if (c.out_f32) p.flags |= jaxflash::kOutputF32;
  const size_t o_elems = size_t(B) * T * N * Hp;
  std::vector<uint8_t> o_bits(o_elems * elem_bytes(out_t), 0xFF);
  DeviceBuffer d_o(o_bits.size()), d_lse(size_t(B) * N * T * 2 * 4);
  CHECK_CUDA(cudaMemcpy(d_o.ptr, o_bits.data(), o_bits.size(), cudaMemcpyHostToDevice));
  if (c.layout == Layout::kBTNH)
    set_view(p.o, d_o.ptr, int64_t(T) * N * Hp, int64_t(G) * Hp, Hp, int64_t(N) * Hp, 1);
  else
    set_view(p.o, d_o.ptr, int64_t(N) * T * Hp, int64_t(G) * T * Hp, int64_t(T) * Hp, Hp, 1);
  auto o_index = [&](int b, int n, int t, int h) -> size_t {
    return c.layout == Layout::kBTNH ? ((size_t(b) * T + t) * N + n) * Hp + h
                                     : ((size_t(b) * N + n) * T + t) * Hp + h;
  };
  set_view(p.lse, d_lse.ptr, int64_t(N) * T * 2, int64_t(G) * T * 2, int64_t(T) * 2, 2, 1);

  // Bias.
  std::vector<double> bias_val;
  std::unique_ptr<DeviceBuffer> d_bias;
  std::function<double(int, int, int, int)> bias_at = [](int, int, int, int) { return 0.0; };
  if (c.bias != Bias::kNone) {
    p.flags |= jaxflash::kHasBias;
    const DType bt = c.bias == Bias::kDtypeHeads ? c.dtype : DType::kF32;
    p.bias_dtype = bt;
    const size_t n = c.bias == Bias::kF32QueryKey ? size_t(T) * S : c.bias == Bias::kDtypeHeads ? size_t(N) * T * S
                                                                                                 : size_t(B) * T;
    HostArray bias(bt, n);
    for (size_t i = 0; i < n; ++i) bias.set(i, 3.f * uni(rng));
    d_bias = std::make_unique<DeviceBuffer>(bias.bits.size());
    CHECK_CUDA(cudaMemcpy(d_bias->ptr, bias.bits.data(), bias.bits.size(), cudaMemcpyHostToDevice));
    bias_val = bias.val;
    if (c.bias == Bias::kF32QueryKey) {
      set_view(p.bias, d_bias->ptr, 0, 0, 0, S, 1);
      bias_at = [&, S](int, int, int t, int s) { return bias_val[size_t(t) * S + s]; };
    } else if (c.bias == Bias::kDtypeHeads) {
      set_view(p.bias, d_bias->ptr, 0, int64_t(G) * T * S, int64_t(T) * S, S, 1);
      bias_at = [&, T, S](int, int n, int t, int s) { return bias_val[(size_t(n) * T + t) * S + s]; };
    } else {
      set_view(p.bias, d_bias->ptr, T, 0, 0, 1, 0);
      bias_at = [&, T](int b, int, int t, int) { return bias_val[size_t(b) * T + t]; };
    }
  }

  // Mask.
  std::vector<uint8_t> mask;
  std::unique_ptr<DeviceBuffer> d_mask;
  std::function<bool(int, int, int)> mask_at = [](int, int, int) { return true; };
  if (c.mask != Mask::kNone) {
    p.flags |= jaxflash::kHasMask;
    std::bernoulli_distribution keep(0.8);
    if (c.mask == Mask::kRandom) {
      mask.resize(size_t(B) * T * S);
      for (auto& m : mask) m = keep(rng);
      for (int s = 0; s < S; ++s) mask[size_t(T / 2) * S + s] = 0;  // batch 0, row T/2: nothing visible
      d_mask = std::make_unique<DeviceBuffer>(mask.size());
      set_view(p.mask, d_mask->ptr, int64_t(T) * S, 0, 0, S, 1);
      mask_at = [&, T, S](int b, int t, int s) { return mask[(size_t(b) * T + t) * S + s] != 0; };
    } else {
      mask.resize(S);
      for (auto& m : mask) m = keep(rng);
      d_mask = std::make_unique<DeviceBuffer>(mask.size());
      set_view(p.mask, d_mask->ptr, 0, 0, 0, 0, 1);
      mask_at = [&](int, int, int s) { return mask[s] != 0; };
    }
    CHECK_CUDA(cudaMemcpy(d_mask->ptr, mask.data(), mask.size(), cudaMemcpyHostToDevice));
  }

  // Sequence lengths: batch 0 gets kv_len 0 (no visible key at all) when B > 1.
  std::vector<int32_t> q_lens(B, T), kv_lens(B, S);
  std::unique_ptr<DeviceBuffer> d_lens;
  if (c.lens) {
    p.flags |= jaxflash::kHasQLens | jaxflash::kHasKvLens;
    for (int b = 0; b < B; ++b) {
      q_lens[b] = std::uniform_int_distribution<int>(1, T)(rng);
      kv_lens[b] = std::uniform_int_distribution<int>(1, S)(rng);
    }
    if (B > 1) kv_lens[0] = 0;
    d_lens = std::make_unique<DeviceBuffer>(2 * B * sizeof(int32_t));
    CHECK_CUDA(cudaMemcpy(d_lens->ptr, q_lens.data(), B * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(static_cast<int32_t*>(d_lens->ptr) + B, kv_lens.data(), B * 4, cudaMemcpyHostToDevice));
    set_view(p.q_lens, d_lens->ptr, 1, 0, 0, 0, 0);
    set_view(p.kv_lens, static_cast<int32_t*>(d_lens->ptr) + B, 1, 0, 0, 0, 0);
    // Keys and values past kv_len are padding that may hold anything: NaN there
    // must not reach any output (0 * NaN in P V). The reference never reads them.
    for (int b = 0; b < B; ++b)
      for (int s = kv_lens[b]; s < S; ++s)
        for (int kh = 0; kh < K; ++kh)
          for (int h = 0; h < H; ++h) k.set(kv_index(b, kh, s, h), NAN), v.set(kv_index(b, kh, s, h), NAN);
    CHECK_CUDA(cudaMemcpy(dk.ptr, k.bits.data(), k.bits.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dv.ptr, v.bits.data(), v.bits.size(), cudaMemcpyHostToDevice));
  }

  // Segment ids, (B, T) and (B, S), shared by the heads (stride 0).
  std::vector<int32_t> q_ids, kv_ids;
  std::unique_ptr<DeviceBuffer> d_ids;
  if (c.segments != Segments::kNone) {
    p.flags |= jaxflash::kHasSegmentIds;
    const uint32_t seed = static_cast<uint32_t>(rng());
    q_ids = segment_ids(c.segments, B, T, -1, seed);
    kv_ids = segment_ids(c.segments, B, S, -2, seed);
    std::vector<int32_t> both(q_ids);
    both.insert(both.end(), kv_ids.begin(), kv_ids.end());
    d_ids = std::make_unique<DeviceBuffer>(both.data(), both.size() * 4);
    set_view(p.q_segment_ids, d_ids->ptr, T, 0, 0, 1, 0);
    set_view(p.kv_segment_ids, static_cast<int32_t*>(d_ids->ptr) + size_t(B) * T, S, 0, 0, 1, 0);
  }
  auto ids_visible = [&](int b, int t, int s) {
    return c.segments == Segments::kNone || q_ids[size_t(b) * T + t] == kv_ids[size_t(b) * S + s];
  };

  // ALiBi: slopes in [0.05, 1) per query head n = kh * G + g (instance strides only).
  std::vector<float> slopes;
  std::unique_ptr<DeviceBuffer> d_slopes;
  if (c.alibi) {
    p.flags |= jaxflash::kHasAlibi;
    std::uniform_real_distribution<float> slope(0.05f, 1.f);
    for (int n = 0; n < N; ++n) slopes.push_back(slope(rng));
    d_slopes = std::make_unique<DeviceBuffer>(slopes.data(), slopes.size() * 4);
    set_view(p.alibi_slopes, d_slopes->ptr, 0, G, 1, 0, 0);
  }

  // The workspace starts 8 bytes into its allocation: any alignment must work.
  const int64_t ws_bytes = jaxflash::gpu::forward_workspace_bytes(p.num_instances(), T, S, H, c.dtype,
                                                                  p.has(jaxflash::kHasSegmentIds));
  DeviceBuffer d_ws(size_t(ws_bytes) + 8);
  CHECK_CUDA(cudaMemset(d_ws.ptr, 0xFF, d_ws.bytes));
  CHECK_CUDA(jaxflash::gpu::launch_forward(p, static_cast<char*>(d_ws.ptr) + 8, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(o_bits.data(), d_o.ptr, o_bits.size(), cudaMemcpyDeviceToHost));
  std::vector<float> lse(size_t(B) * N * T * 2);
  CHECK_CUDA(cudaMemcpy(lse.data(), d_lse.ptr, lse.size() * 4, cudaMemcpyDeviceToHost));
  HostArray o(out_t, o_elems);
  o.bits = o_bits;

  // Reference, row by row; the position rule is params.h's own.
  double err_o = 0, err_lse = 0, max_o = 0, max_lse = 0;  // max_*: of the finite reference values
  int64_t bad_special = 0, bad_pad = 0;
  std::vector<double> logit(S), prob(S);
  for (int b = 0; b < B; ++b)
    for (int kh = 0; kh < K; ++kh)
      for (int g = 0; g < G; ++g) {
        const int n = kh * G + g;
        // instance_bounds() from the host copies of the lengths (p holds device pointers).
        jaxflash::InstanceBounds hb{T, S, 0};
        if (c.lens) hb.q_len = q_lens[b], hb.kv_len = kv_lens[b];
        if (c.bottom_right) hb.offset = hb.kv_len - hb.q_len;
        for (int t = 0; t < T; ++t) {
          double mx = -INFINITY;
          for (int s = 0; s < S; ++s) {
            logit[s] = -INFINITY;
            if (!jaxflash::position_visible(p, hb, t, s) || !mask_at(b, t, s) || !ids_visible(b, t, s)) continue;
            double dot = 0;
            for (int h = 0; h < H; ++h) dot += q.val[q_index(b, n, t, h)] * k.val[kv_index(b, kh, s, h)];
            logit[s] = p.scale * dot;
            if (c.softcap > 0.f) logit[s] = c.softcap * std::tanh(logit[s] / c.softcap);
            logit[s] += bias_at(b, n, t, s);
            if (c.alibi) logit[s] -= slopes[n] * std::fabs(double(s) - t - hb.offset);
            mx = std::max(mx, logit[s]);
          }
          double sum = 0;
          for (int s = 0; s < S; ++s) sum += prob[s] = mx == -INFINITY ? 0.0 : std::exp(logit[s] - mx);
          const double ref_lse = sum > 0 ? (mx + std::log(sum)) / std::log(2.0) : -INFINITY;  // base 2
          const size_t row = (size_t(b) * N + n) * T + t;
          const double got_lse = double(lse[2 * row]) + (std::isinf(lse[2 * row]) ? 0.0 : double(lse[2 * row + 1]));
          if (std::isinf(ref_lse) || std::isinf(got_lse) || std::isnan(got_lse)) {
            bad_special += !(std::isinf(got_lse) && got_lse < 0 && std::isinf(ref_lse));
          } else {
            err_lse = std::max(err_lse, std::fabs(got_lse - ref_lse));
            max_lse = std::max(max_lse, std::fabs(ref_lse));
          }
          for (int h = 0; h < H; ++h) {
            double ref = 0;
            if (sum > 0)
              for (int s = 0; s < S; ++s)
                if (prob[s] != 0) ref += prob[s] / sum * v.val[kv_index(b, kh, s, h)];
            const double got = o.get(o_index(b, n, t, h));
            if (std::isnan(got)) ++bad_special;
            else if (sum == 0 && got != 0) ++bad_special;
            else err_o = std::max(err_o, std::fabs(got - ref));
            max_o = std::max(max_o, std::fabs(ref));
          }
          for (int h = H; h < Hp; ++h) {  // untouched: still the all-ones sentinel
            const size_t i = o_index(b, n, t, h) * elem_bytes(out_t);
            for (int byte = 0; byte < elem_bytes(out_t); ++byte) bad_pad += o.bits[i + byte] != 0xFF;
          }
        }
      }

  // 16-bit and tf32 products carry 8 or 11 significant bits: loose absolute
  // bounds. kExactF32 must be fp32-accurate: 2e-5 of the largest reference
  // value (at least 1). Emulating the kernel's arithmetic on these shapes
  // (tensor cores truncating as they do) puts 3xTF32 below 0.1 of that bound
  // and tf32 products 9-38x above it for o, so an exact case cannot pass on
  // tf32 arithmetic.
  const double tol_o =
      c.exact ? 2e-5 * std::max(1.0, max_o) : c.dtype == DType::kBF16 ? 2e-2 : c.dtype == DType::kF16 ? 4e-3 : 4e-3;
  const double tol_lse = c.exact ? 2e-5 * std::max(1.0, max_lse) : 1e-2;
  const bool ok = err_o <= tol_o && err_lse <= tol_lse && bad_special == 0 && bad_pad == 0;
  std::printf("%-4s %-52s max|do| %.2e (tol %.1e)  max|dlse| %.2e (tol %.1e)  bad special %lld  pad writes %lld\n",
              ok ? "PASS" : "FAIL", c.name.c_str(), err_o, tol_o, err_lse, tol_lse, (long long)bad_special,
              (long long)bad_pad);
  return ok;
}

#ifdef JAXFLASH_FWD_TIMELINE
// Where the last launch's consumer warpgroups spent their query tiles (timeline.h): per
// warpgroup, the mean over its computed tiles of each phase, in us, and of a round of the
// rounds' loop (each tile's first S product is in "first S", its last P V in "last PV").
void fwd_timeline_report() {
  using namespace jaxflash::gpu;
  std::vector<unsigned long long> t(size_t(kTlCtas) * kFtRowWords);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(t.data(), fwd_timeline_buffer(), t.size() * sizeof(t[0]), cudaMemcpyDeviceToHost));
  const char* names[kFtTiles] = {"Q wait", "first S", "rounds", "last PV", "epilogue", "to next"};
  for (int wg = 0; wg < 3; ++wg) {
    double sum[kFtTiles] = {}, tiles = 0, rounds = 0, ctas = 0;
    for (int c = 0; c < kTlCtas; ++c) {
      const unsigned long long* w = t.data() + size_t(c) * kFtRowWords + wg * kFtPhases;
      for (int e = 0; e < kFtTiles; ++e) sum[e] += double(w[e]);
      tiles += double(w[kFtTiles]), rounds += double(w[kFtRoundCount]), ctas += w[kFtTiles] > 0;
    }
    if (tiles == 0) continue;
    std::printf("    warpgroup %d: %.0f tiles, %.2f key tiles each; us per tile:", wg, tiles, rounds / tiles);
    for (int e = 0; e < kFtTiles; ++e)  // the gaps: one fewer than the tiles per CTA
      std::printf(" %s %.2f", names[e], sum[e] / (e == kFtNext ? std::max(tiles - ctas, 1.0) : tiles) / 1e3);
    std::printf("; a round %.3f\n", sum[kFtRounds] / std::max(rounds - tiles, 1.0) / 1e3);
  }
}
#endif

void bench(const BenchFilter& only = {}) {
  std::printf("\nbf16 forward, batch x seqlen = 16384 tokens, hidden 2048 (FlashAttention's protocol)\n");
  for (int H : {64, 128, 256})
    for (bool causal : {false, true})
      for (int L : {1024, 4096, 16384}) {
        if (only.skips(H, L, causal)) continue;
        // Rows of L tokens, or (only.packed) those rows packed into one with segment ids.
        const int B = only.packed ? 1 : 16384 / L, T = only.packed ? 16384 : L, N = 2048 / H;
        const size_t n = size_t(B) * T * N * H;
        DeviceBuffer q(2 * n), k(2 * n), v(2 * n), o(2 * n), lse(2 * 4 * size_t(B) * N * T);
        std::vector<__nv_bfloat16> host(n);
        std::mt19937 rng(1);
        std::uniform_real_distribution<float> uni(-1.f, 1.f);
        for (auto& x : host) x = __float2bfloat16_rn(uni(rng));
        for (void* dst : {q.ptr, k.ptr, v.ptr}) CHECK_CUDA(cudaMemcpy(dst, host.data(), 2 * n, cudaMemcpyHostToDevice));
        AttentionParams p;
        p.dtype = DType::kBF16;
        p.num_inst_dims = 2;
        p.inst_size[0] = B, p.inst_size[1] = N;
        p.seqlen_q = p.seqlen_k = T, p.head_dim = H;
        p.scale = 1.f / std::sqrt(float(H));
        if (causal) p.window_right = 0;
        for (ArrayView* view : {&p.q, &p.k, &p.v, &p.o}) {
          view->inst_stride[0] = int64_t(T) * N * H, view->inst_stride[1] = H;
          view->row_stride = int64_t(N) * H, view->col_stride = 1;
        }
        p.q.data = q.ptr, p.k.data = k.ptr, p.v.data = v.ptr, p.o.data = o.ptr;
        set_view(p.lse, lse.ptr, int64_t(N) * T * 2, int64_t(T) * 2, 0, 2, 1);
        DeviceBuffer ids(only.packed ? 4 * size_t(T) : 0);
        if (only.packed) set_packed_ids(p, ids, T, L);
        DeviceBuffer ws(jaxflash::gpu::forward_workspace_bytes(p.num_instances(), T, T, H, p.dtype, only.packed));
        cudaEvent_t start, stop;
        CHECK_CUDA(cudaEventCreate(&start));
        CHECK_CUDA(cudaEventCreate(&stop));
        for (int i = 0; i < 3; ++i) CHECK_CUDA(jaxflash::gpu::launch_forward(p, ws.ptr, nullptr));
        const int iters = 20;
        CHECK_CUDA(cudaEventRecord(start));
        for (int i = 0; i < iters; ++i) CHECK_CUDA(jaxflash::gpu::launch_forward(p, ws.ptr, nullptr));
        CHECK_CUDA(cudaEventRecord(stop));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        ms /= iters;
        const double flops = 4.0 * (16384 / L) * N * double(L) * L * H / (causal ? 2 : 1);  // packed: the same
        std::printf("  H=%3d %-6s N=%5d%s  %8.3f ms  %6.1f TFLOP/s\n", H, causal ? "causal" : "", L,
                    only.packed ? " packed" : "", ms, flops / ms / 1e9);
#ifdef JAXFLASH_FWD_TIMELINE
        CHECK_CUDA(jaxflash::gpu::launch_forward(p, ws.ptr, nullptr));  // alone: its CTAs' sums
        fwd_timeline_report();
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
  std::vector<Case> cases = {
      {"bf16 causal T113 S203 H64", bf16, 2, 3, 3, 113, 203, 64, kUnb, 0},
      {"f16 causal T113 S203 H64", f16, 2, 3, 3, 113, 203, 64, kUnb, 0},
      {"f16 T1 S37 H128", f16, 2, 2, 2, 1, 37, 128},
      {"bf16 T1 S37 H128 causal bottom-right", bf16, 2, 2, 2, 1, 37, 128, kUnb, 0, true},
      {"f16 window (17, 5) T150 S150 H96", f16, 1, 2, 2, 150, 150, 96, 17, 5},
      {"bf16 window left 40 only T300 S260 H32", bf16, 1, 2, 1, 300, 260, 32, 40, kUnb},
      {"bf16 GQA N8 K2 T77 S300 H128", bf16, 2, 8, 2, 77, 300, 128},
      {"f16 bias f32 (T,S) bottom-right causal T200 S100 H32", f16, 2, 2, 2, 200, 100, 32, kUnb, 0, true,
       Bias::kF32QueryKey},
      {"bf16 bias dtype (N,T,S) T130 S190 H64", bf16, 2, 4, 2, 130, 190, 64, kUnb, kUnb, false, Bias::kDtypeHeads},
      {"f16 bias f32 (B,T) col stride 0 T70 S90 H80", f16, 3, 2, 2, 70, 90, 80, kUnb, kUnb, false,
       Bias::kF32RowOnly},
      {"bf16 mask (B,T,S) + empty row T129 S140 H128", bf16, 2, 2, 2, 129, 140, 128, kUnb, kUnb, false,
       Bias::kNone, Mask::kRandom},
      {"f16 key-padding mask (S) causal T100 S100 H64", f16, 2, 2, 2, 100, 100, 64, kUnb, 0, false, Bias::kNone,
       Mask::kKeyPadding},
      {"bf16 lens + bottom-right causal T90 S120 H59 (unaligned)", bf16, 3, 2, 1, 90, 120, 59, kUnb, 0, true,
       Bias::kNone, Mask::kNone, true},
      {"f16 lens + window (8, 8) T64 S64 H128", f16, 3, 2, 2, 64, 64, 128, 8, 8, false, Bias::kNone, Mask::kNone,
       true},
      {"bf16 lens T200 S333 H64", bf16, 3, 2, 2, 200, 333, 64, kUnb, kUnb, false, Bias::kNone, Mask::kNone, true},
      {"f16 lens + causal T300 S290 H128", f16, 3, 4, 2, 300, 290, 128, kUnb, 0, false, Bias::kNone, Mask::kNone,
       true},
      {"bf16 T130 S257 H200 (D256)", bf16, 1, 2, 2, 130, 257, 200},
      // D = 256 at 16 bits: the sm_90 kernel on Hopper (64-key tiles).
      {"bf16 causal GQA N4 K2 T300 S333 H256", bf16, 2, 4, 2, 300, 333, 256, kUnb, 0},
      {"f16 lens T200 S257 H256", f16, 3, 2, 2, 200, 257, 256, kUnb, kUnb, false, Bias::kNone, Mask::kNone,
       true},
      {"f16 causal T64 S129 H160 (D192)", f16, 2, 2, 1, 64, 129, 160, kUnb, 0},
      {"bf16 BNTH q/o T256 S512 H128", bf16, 2, 2, 2, 256, 512, 128, kUnb, kUnb, false, Bias::kNone, Mask::kNone,
       false, Layout::kBNTH},
      {"bf16 causal T1024 S1024 H128", bf16, 1, 2, 2, 1024, 1024, 128, kUnb, 0},
      {"f16 T300 S1000 H64 scale 0.5", f16, 1, 2, 2, 300, 1000, 64, kUnb, kUnb, false, Bias::kNone, Mask::kNone,
       false, Layout::kBTNH, 0.5f},
      {"f16 T40 S50 H64 negative scale", f16, 1, 1, 1, 40, 50, 64, kUnb, kUnb, false, Bias::kNone, Mask::kNone,
       false, Layout::kBTNH, -0.3f},
      {"bf16 causal T113 S203 H64, f32 o", bf16, 2, 3, 3, 113, 203, 64, kUnb, 0, false, Bias::kNone, Mask::kNone,
       false, Layout::kBTNH, 0.f, true},
      {"f16 mask T129 S140 H72, f32 o", f16, 2, 2, 2, 129, 140, 72, kUnb, kUnb, false, Bias::kNone, Mask::kRandom,
       false, Layout::kBTNH, 0.f, true},
      {"f32 causal T77 S130 H72", f32, 2, 2, 2, 77, 130, 72, kUnb, 0},
      {"f32 T40 S70 H256", f32, 1, 2, 2, 40, 70, 256},
      {"f32 T65 S33 H32 mask + bias", f32, 2, 2, 2, 65, 33, 32, kUnb, kUnb, false, Bias::kF32QueryKey,
       Mask::kRandom},
      {"f32 T50 S300 H192 lens", f32, 2, 2, 2, 50, 300, 192, kUnb, kUnb, false, Bias::kNone, Mask::kNone, true},
      {"f32 T128 S128 H128 window (3, 0)", f32, 1, 2, 2, 128, 128, 128, 3, 0},
      // kOutputF32 at float32: the differentiated forward's P whole in P.V (kTf32WholeP).
      {"f32 causal T77 S130 H72, f32 o", f32, 2, 2, 2, 77, 130, 72, kUnb, 0, false, Bias::kNone, Mask::kNone,
       false, Layout::kBTNH, 0.f, true},
      {"f32 T200 S300 H128 mask, f32 o", f32, 1, 4, 2, 200, 300, 128, kUnb, kUnb, false, Bias::kNone, Mask::kRandom,
       false, Layout::kBTNH, 0.f, true},
      // kExactF32: fast and general variants, head dims 64 / 72 / 128 / 256
      // (and 32 / 192), odd shapes, causal, bias, mask, lengths, GQA.
      exact({"f32 causal T77 S130 H72", f32, 2, 2, 2, 77, 130, 72, kUnb, 0}),
      exact({"f32 T200 S300 H64 GQA", f32, 2, 4, 2, 200, 300, 64}),
      exact({"f32 causal bottom-right T113 S203 H64", f32, 1, 2, 2, 113, 203, 64, kUnb, 0, true}),
      exact({"f32 T128 S256 H128", f32, 1, 2, 2, 128, 256, 128}),
      exact({"f32 T40 S70 H256", f32, 1, 2, 2, 40, 70, 256}),
      exact({"f32 T65 S33 H32 mask + bias", f32, 2, 2, 2, 65, 33, 32, kUnb, kUnb, false, Bias::kF32QueryKey,
             Mask::kRandom}),
      exact({"f32 bias (N,T,S) causal T99 S140 H128", f32, 2, 2, 1, 99, 140, 128, kUnb, 0, false,
             Bias::kDtypeHeads}),
      exact({"f32 T50 S300 H192 lens", f32, 2, 2, 2, 50, 300, 192, kUnb, kUnb, false, Bias::kNone, Mask::kNone,
             true}),
      // Segment ids (the general variants): documents in order (tiles skipped, batch 1 ending
      // in padding ids), documents on tile boundaries, ids in any order; causal, GQA, lengths.
      with_segments({"bf16 segments docs T300 S300 H64", bf16, 2, 2, 2, 300, 300, 64}, Segments::kDocs),
      with_segments({"f16 segments docs causal GQA N4 K2 T257 S257 H128", f16, 2, 4, 2, 257, 257, 128, kUnb, 0},
                    Segments::kDocs),
      with_segments({"bf16 segments tile docs causal T384 S384 H64", bf16, 2, 2, 1, 384, 384, 64, kUnb, 0},
                    Segments::kTileDocs),
      with_segments({"f16 segments tile docs T320 S448 H128", f16, 2, 2, 2, 320, 448, 128}, Segments::kTileDocs),
      with_segments({"bf16 segments docs + lens, bottom-right causal T200 S333 H64", bf16, 3, 2, 1, 200, 333, 64,
                     kUnb, 0, true, Bias::kNone, Mask::kNone, true},
                    Segments::kDocs),
      with_segments({"f16 segments random ids + mask T129 S140 H96", f16, 2, 2, 2, 129, 140, 96, kUnb, kUnb, false,
                     Bias::kNone, Mask::kRandom},
                    Segments::kRandom),
      with_segments({"bf16 segments docs + window (40, 3) + bias T260 S260 H32", bf16, 2, 2, 2, 260, 260, 32, 40, 3,
                     false, Bias::kF32QueryKey},
                    Segments::kDocs),
      with_segments({"f32 segments docs causal T200 S200 H72", f32, 2, 2, 2, 200, 200, 72, kUnb, 0},
                    Segments::kDocs),
      with_segments(exact({"f32 segments tile docs GQA T256 S320 H128", f32, 2, 4, 2, 256, 320, 128}),
                    Segments::kTileDocs),
      // Soft-cap and ALiBi: on Hopper the 16-bit D = 64 / 128 / 256 cases run the sm_90
      // kernel's score-modifier copy, the others (and all in fwd_mma_selftest) mma.sync's.
      with_softcap({"bf16 soft-cap 2.5 causal T300 S300 H128", bf16, 2, 2, 2, 300, 300, 128, kUnb, 0}, 2.5f),
      with_softcap(with_alibi({"f16 soft-cap 5 + alibi GQA T257 S300 H64", f16, 2, 4, 2, 257, 300, 64}), 5.f),
      with_alibi({"bf16 alibi + lens, bottom-right causal T200 S333 H64", bf16, 3, 2, 1, 200, 333, 64, kUnb, 0,
                  true, Bias::kNone, Mask::kNone, true}),
      with_alibi(with_segments({"bf16 alibi + segments docs causal T384 S384 H128", bf16, 2, 2, 2, 384, 384, 128,
                                kUnb, 0},
                               Segments::kDocs)),
      with_softcap(with_segments({"f16 soft-cap 1.5 + segments tile docs T320 S448 H256", f16, 2, 2, 2, 320, 448,
                                  256},
                                 Segments::kTileDocs),
                   1.5f),
      with_softcap({"bf16 soft-cap 3 + window (50, 10), scale -0.3 T200 S260 H128", bf16, 2, 2, 2, 200, 260, 128, 50,
                    10, false, Bias::kNone, Mask::kNone, false, Layout::kBTNH, -0.3f},
                   3.f),
      with_softcap(with_alibi({"f16 soft-cap 4 + alibi + bias T129 S140 H96", f16, 2, 2, 2, 129, 140, 96, kUnb, kUnb,
                               false, Bias::kF32QueryKey}),
                   4.f),
      with_softcap(with_alibi({"f32 soft-cap 2 + alibi causal T100 S120 H64", f32, 2, 2, 2, 100, 120, 64, kUnb, 0}),
                   2.f),
      // More tiles than an H100 has SMs: on Hopper the persistent sm_90 kernel (16-bit D = 64 /
      // 128 / 256) computes several per CTA, in turn (last in the list, so that the cases
      // before draw the same inputs as before them). Causal tiles of uneven length, GQA,
      // lengths (batch 0 has no keys: tiles that load nothing; rows past q_len: tiles of
      // padding), whole tiles with no visible key (bottom-right causal, T > S) and f32 o,
      // segment ids that skip key tiles, D = 256 (O staged in Q's buffer).
      {"bf16 many tiles causal GQA lens B12 N16 K4 T160 S160 H128", bf16, 12, 16, 4, 160, 160, 128, kUnb, 0, false,
       Bias::kNone, Mask::kNone, true},
      {"f16 many tiles bottom-right causal T400 S100 H128, f32 o", f16, 4, 16, 4, 400, 100, 128, kUnb, 0, true,
       Bias::kNone, Mask::kNone, false, Layout::kBTNH, 0.f, true},
      {"bf16 many tiles causal lens B8 N16 T250 S250 H64", bf16, 8, 16, 16, 250, 250, 64, kUnb, 0, false,
       Bias::kNone, Mask::kNone, true},
      with_segments({"f16 many tiles segments docs causal B8 N8 K2 T300 S300 H128", f16, 8, 8, 2, 300, 300, 128,
                     kUnb, 0},
                    Segments::kDocs),
      {"bf16 many tiles causal lens B6 N12 K4 T260 S260 H256", bf16, 6, 12, 4, 260, 260, 256, kUnb, 0, false,
       Bias::kNone, Mask::kNone, true},
  };
  std::mt19937 rng(1234);
  int passed = 0, failed = 0;
  const std::string arg = argc > 1 ? argv[1] : "";
  const bool bench_too = arg == "bench";
  for (const Case& c : cases)
    if (arg.empty() || bench_too || c.name.find(arg) != std::string::npos) (run_case(c, rng) ? passed : failed)++;
  std::printf("%d passed, %d failed\n", passed, failed);
  if (bench_too) bench();
  return failed == 0 ? 0 : 1;
}
