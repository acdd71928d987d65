// Compile-time shape of one forward kernel instantiation, derived from the
// element type, the padded head dim and tile_size.h; and the launch-time values
// the launcher precomputes for it.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>
#include <type_traits>

#include "primitives/ptx.h"
#include "primitives/smem_tile.h"
#include "primitives/softmax.h"
#include "primitives/tma.h"
#include "segment_tiles.h"
#include "tile_size.h"
#include "../params.h"

namespace jaxflash::gpu {

// Two variants per (T, D): the fast one, for the common case, and the general
// one for everything else, so the fast one carries none of the registers the
// rare features need:
//   fast    : no bias, no mask, scale > 0, head_dim == D, rows of q, k and v
//             16-byte aligned
//   general : everything else: bias and / or mask, dropout, segment ids, any
//             scale, padded head dims, any row alignment (element-wise fallback copy)
// kF32Mma: how float32 operands go through the tensor cores (ptx.h; tf32 by
// default, 3xTF32 under kExactF32); the same tiles either way.
// kSegmentIds: a copy of the general variant for segment ids (segment_tiles.h):
// its tile skipping and element test cost registers that the general variant,
// at 255 of them, would pay in spills for every call (bf16 D = 256 on sm_80:
// 0 -> 60 / 164 bytes stored / loaded).
template <class T_, int D, bool kGeneral_, F32Mma kF32Mma_ = F32Mma::kTf32, bool kSegmentIds_ = false>
struct FwdConfig {
  using T = T_;
  static constexpr int kHeadDim = D;                // padded; columns >= head_dim are zero
  static constexpr bool kGeneral = kGeneral_;
  static constexpr F32Mma kF32Mma = kF32Mma_;
  static constexpr bool kSegmentIds = kSegmentIds_;
  static constexpr bool kBiasMask = kGeneral;  // score_tile (fwd_scores.h) reads a bias and a mask
  static_assert(kF32Mma == F32Mma::kTf32 || sizeof(T) == 4, "3xTF32 is a float32 mode");
  static_assert(kGeneral || !kSegmentIds, "segment ids are in the general variant");
  static constexpr int kBlockM = FwdTileSize<sizeof(T), D, kGeneral>::kBlockM;
  static constexpr int kBlockN = FwdTileSize<sizeof(T), D, kGeneral>::kBlockN;
  static constexpr bool kSplitSteps = FwdTileSize<sizeof(T), D, kGeneral>::kSplitSteps;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kWarpRows = kBlockM / kWarps;  // each warp owns these query rows outright
  static constexpr int kMF = kWarpRows / 16;          // m16 fragments per warp
  static constexpr int kNF = kBlockN / 8;             // n8 fragments of a score tile
  static constexpr int kDF = D / 8;                   // n8 fragments of O
  static_assert(kWarpRows % 16 == 0, "a warp owns whole m16 fragments");
  // Each row's largest score, for the normaliser's correction (softmax_finalize): not in the
  // fast 16-bit variant, where its two registers per m16 row cost spills (ptxas bf16 D = 128:
  // sm_80 188 / 356 -> 276 / 416 bytes stored / loaded, sm_90a 140 / 308 -> 308 / 432). That
  // variant runs 16-bit calls the sm_90 kernels do not take (D = 32 / 96 / 192 on Hopper, every
  // D on sm_80 / sm_89).
  static constexpr bool kTrackMax = kGeneral || sizeof(T) == 4;
  using State = SoftmaxState<kMF, kTrackMax>;

  using QTile = SmemTile<T, kBlockM, D>;  // Q, then O on its way out
  using KTile = SmemTile<T, kBlockN, D>;
  using VTile = SmemTile<T, kBlockN, D>;
  static constexpr int kSmemBytes = QTile::kBytes + KTile::kBytes + VTile::kBytes;
};

// Every operand's origin at one CTA's instance (see instance.h).
template <class T>
struct FwdOperands {
  const T *q, *k, *v;
  const void* bias;     // T or float (FwdRuntime::bias_f32); null when absent or unread
  const uint8_t* mask;  // null when absent or unread
  const uint32_t* seed; // the dropout's seed words; null without dropout (general variant only)
  const int32_t* q_ids;   // segment ids; null without them (general variant only)
  const int32_t* kv_ids;
  float alibi2;  // ALiBi: log2 e * the instance's slope; 0 without (general variant only)
  void* o;     // T, or float with kOutputF32
  float* lse;  // null when absent
};

// Launch-time values, computed once on the host (see forward.cu).
struct FwdRuntime {
  // Scores reach the softmax as s, in units where exp2(s * exp_scale) is the
  // unnormalised probability. Without a bias and with scale > 0 the raw Q.K^T
  // goes straight in (exp_scale = scale * log2 e, applied inside the FFMA of
  // the exp2). Otherwise the scores are first rewritten as
  // s * score_mul + bias * log2 e (score_mul = scale * log2 e) and exp_scale = 1,
  // soft-capped before the bias is added when there is a cap.
  float exp_scale;
  // P is computed as 2^-p_shift of the probability (params.h, probability_shift),
  // folded into the exp2's offset; 0 for fp16, whose max (65504) cannot overflow
  // float32 that way and whose P would lose precision to subnormals.
  float p_shift;
  float score_mul;
  bool fold_scale;
  float softcap2;  // log2 e * logits_soft_cap (primitives/score.h), 0 without one (general variant)
  float out_scale;  // O's factor after normalisation: 1, or 1 / (1 - rate) with dropout
  bool bias_f32;  // bias is float32 rather than the input dtype
  // 16-byte-aligned rows (base, row and instance strides; for o in its output
  // type): cp.async and vector stores; otherwise the element-wise fallback.
  bool q_vec, k_vec, v_vec, o_vec;
  // The grid's instance groups (fwd_schedule.h).
  int sms;             // the device's multiprocessors (forward.cu)
  int64_t tile_group;  // instances per group (the launcher)
  int instances;       // p.num_instances() (the launcher), which the tile decode would multiply out per tile
  // The persistent sm_90 kernel's tiles (the launcher) and the counter its CTAs take them
  // from (next_persistent_tile), 4 bytes of the forward's workspace (forward.cu).
  int tiles;
  unsigned* tile_counter;
  // The sm_90 kernel runs (forward.cu: the device runs sm_90a code, the case
  // is covered, every operand has a TMA descriptor), with these descriptors:
  // o's (16-bit O only) in boxes of a consumer warp's 16 rows, its TMA stores.
  bool sm90;
  bool sm90_wide_keys;  // with 160-key tiles (tile_size.h's fwd_sm90_wide_keys)
  TmaOperand tma_q, tma_k, tma_v, tma_o;
  // Segment ids: the id ranges of the tiles of the kernel that runs (the sm_90 one's or the
  // general variant's), in the forward's scratch (segment_tiles.h); null tables without ids.
  SegmentTiles segments;
#ifdef JAXFLASH_FWD_TIMELINE
  unsigned long long* timeline;  // timeline.h
#endif
};

// The runtime a forward kernel computes instance `linear` with: the launch's, with score_mul
// from that instance's scale under kScaleOperand (a traced scale: device memory, which the host
// cannot read without synchronising; the launcher folds the scale then, fold_scale, so score_mul
// is all it reads).
__device__ __forceinline__ FwdRuntime with_scale_operand(const AttentionParams& p, FwdRuntime rt, int64_t linear) {
  if (p.has(kScaleOperand)) rt.score_mul = instance_scale(p, linear) * kLog2e;
  return rt;
}

// Whether the scores go through more than the scale inside the exp2 (score_tile's general
// steps besides bias and mask): a folded scale (a scale operand, scale <= 0, the soft-cap,
// ALiBi) or segment ids.
inline bool fwd_score_mods(const AttentionParams& p, const FwdRuntime& rt) {
  return rt.fold_scale || p.has(kHasSegmentIds);
}

// The sm_90 forward's copy for the call's score modifiers (tile_size.h's FwdMods), given
// fwd_sm90_case. The soft-cap's copy folds any scale (a traced one, one <= 0) into its tanh's
// argument; ALiBi's and the segment ids' copies take a scale > 0 inside the exp2, as the plain
// copy does, so with a scale that must be folded they run in the general copy.
inline FwdMods fwd_sm90_mods(const AttentionParams& p, const FwdRuntime& rt) {
  const bool capped = rt.softcap2 > 0.f, alibi = p.has(kHasAlibi), ids = p.has(kHasSegmentIds);
  const bool scale_in_exp2 = !p.has(kScaleOperand) && p.scale > 0.f;
  if (!fwd_score_mods(p, rt)) return FwdMods::kNone;
  if (capped && !alibi && !ids) return FwdMods::kSoftCap;
  if (alibi && !capped && !ids && scale_in_exp2) return FwdMods::kAlibi;
  if (ids && !capped && !alibi && scale_in_exp2) return FwdMods::kSegmentIds;
  return FwdMods::kGeneral;
}

// Calls f(std::integral_constant<FwdMods, M>{}) for the copy `mods` and returns its result: the
// copy's shape (forward.cu) and its launch (fwd_launch.h) name it alike.
template <class F>
auto with_fwd_mods(FwdMods mods, F&& f) {
  switch (mods) {
    case FwdMods::kSoftCap: return f(std::integral_constant<FwdMods, FwdMods::kSoftCap>{});
    case FwdMods::kAlibi: return f(std::integral_constant<FwdMods, FwdMods::kAlibi>{});
    case FwdMods::kSegmentIds: return f(std::integral_constant<FwdMods, FwdMods::kSegmentIds>{});
    case FwdMods::kGeneral: return f(std::integral_constant<FwdMods, FwdMods::kGeneral>{});
    default: return f(std::integral_constant<FwdMods, FwdMods::kNone>{});
  }
}

// The fast variants' conditions that hold for any head dim: no bias, mask or
// score modifiers, rows of q, k and v 16-byte aligned. The mma.sync fast
// variant also wants no dropout and head_dim == D (fwd_launch.h).
inline bool fwd_fast_case(const AttentionParams& p, const FwdRuntime& rt) {
  return !p.has(kHasBias) && !p.has(kHasMask) && !fwd_score_mods(p, rt) && rt.q_vec && rt.k_vec && rt.v_vec;
}

// The sm_90 kernel's conditions for any covered head dim (tile_size.h): no bias or mask, rows
// of q, k and v 16-byte aligned (its TMA boxes), and dropout or score modifiers, each in a copy
// of its own, but not both (their registers together would spill; the mma.sync general variant
// runs those).
inline bool fwd_sm90_case(const AttentionParams& p, const FwdRuntime& rt) {
  return !p.has(kHasBias) && !p.has(kHasMask) && rt.q_vec && rt.k_vec && rt.v_vec &&
         !(fwd_score_mods(p, rt) && p.has(kDropout));
}

}  // namespace jaxflash::gpu
