// Compile-time shape of one backward instantiation (from bwd_tile_size.h),
// the launch-time values the host computes once (BwdRuntime), the workspace
// layout, and the instance-space split of the K/V-outer pass.
#pragma once

#include <cstdint>

#include "bwd_tile_size.h"
#include "primitives/ptx.h"
#include "primitives/smem_tile.h"
#include "primitives/tma.h"
#include "segment_tiles.h"
#include "../params.h"

namespace jaxflash::gpu {

// Two variants per (T, D), as in the forward: the fast one (no bias, no mask,
// no segment ids, q/k/v/dO rows 16-byte aligned) and the general one. kF32Mma: how float32
// operands go through the tensor cores (primitives/ptx.h; tf32 by default,
// 3xTF32 under kExactF32), on the same tiles.
// kSoftcap: a copy of the general variant for a logit soft-cap, whose main
// kernel keeps each score's tanh slope from P to dS (a register per score
// that the copy without keeps for itself).
// kSegmentIds: a copy of the general variant (main and dbias kernels) for
// segment ids (segment_tiles.h): their tile skipping, dQ turn count and element
// test cost registers that the general variant, at 255 of them, would pay in
// spills for every call (bf16 D = 192 on sm_90a: 48 / 12 -> 232 / 308 bytes
// stored / loaded).
template <class T_, int D, bool kGeneral_, F32Mma kF32Mma_ = F32Mma::kTf32, bool kSoftcap_ = false,
          bool kSegmentIds_ = false>
struct BwdConfig {
  using T = T_;
  static constexpr int kHeadDim = D;
  static constexpr bool kGeneral = kGeneral_;
  static constexpr F32Mma kF32Mma = kF32Mma_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kSegmentIds = kSegmentIds_;
  static_assert(kGeneral || !kSoftcap, "the soft-cap is in the general variant");
  static_assert(kGeneral || !kSegmentIds, "segment ids are in the general variant");
  static_assert(kF32Mma == F32Mma::kTf32 || sizeof(T) == 4, "3xTF32 is a float32 mode");
  static constexpr BwdTiles kTiles = bwd_tiles(static_cast<int>(sizeof(T)), D, kGeneral);
  static constexpr int kBlockM = kTiles.block_m;
  static constexpr int kBlockN = kTiles.block_n;
  static constexpr int kWarps = kTiles.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMinBlocks = kTiles.min_blocks;

  // S / dP: BLOCK_M x BLOCK_N.
  static constexpr int kSWarpsM = kTiles.s_warps_m, kSWarpsN = kWarps / kSWarpsM;
  static constexpr int kSRows = kBlockM / kSWarpsM, kSCols = kBlockN / kSWarpsN;
  static constexpr int kSMF = kSRows / 16, kSNF = kSCols / 8;
  // dK, dV: BLOCK_N x D.
  static constexpr int kKVWarpsM = kTiles.kv_warps_m, kKVWarpsN = kWarps / kKVWarpsM;
  static constexpr int kKVRows = kBlockN / kKVWarpsM, kKVCols = D / kKVWarpsN;
  static constexpr int kKVMF = kKVRows / 16, kKVNF = kKVCols / 8;
  // dQ: BLOCK_M x D, in kQChunks column chunks.
  static constexpr BwdDqGrid kDq = bwd_dq_grid(static_cast<int>(sizeof(T)), D);
  static constexpr int kQChunks = kDq.chunks, kQChunkCols = kDq.chunk_cols;
  static constexpr int kQWarpsM = kTiles.q_warps_m, kQWarpsN = kDq.warps_n;
  static constexpr int kQRows = kDq.rows, kQCols = kDq.cols;
  static constexpr int kQMF = kDq.mf, kQNF = kDq.nf;

  static_assert(kSWarpsM * kSWarpsN == kWarps && kKVWarpsM * kKVWarpsN == kWarps && kQWarpsM * kQWarpsN == kWarps,
                "warp grids cover the CTA");
  static_assert(kSRows % 16 == 0 && kSCols % 8 == 0, "S grid: whole m16n8 fragments");
  static_assert(kKVRows % 16 == 0 && kKVCols % 8 == 0 && kKVWarpsN * kKVCols == D, "dK/dV grid");
  static_assert(kQRows % 16 == 0 && kQCols % 8 == 0 && kQChunks * kQWarpsN * kQCols == D, "dQ grid");
  // The workspace layout is the variants' common ground.
  static_assert(kBlockM == kDq.block_m && kQWarpsM * kQWarpsN == kWarps && kTiles.q_chunks == kDq.chunks &&
                    kBlockM / kQWarpsM == kDq.rows,
                "both variants share BLOCK_M and the dQ grid");

  using QTile = SmemTile<T, kBlockM, D>;        // Q and dO
  using KTile = SmemTile<T, kBlockN, D>;        // K and V (then dK, dV on the way out)
  using PTile = SmemTile<T, kBlockM, kBlockN>;  // P and dS, [query][key]
  static constexpr int kQStages = kTiles.q_stages;
  static_assert(kQStages == 1 || kQStages == 2, "Q / dO single or double buffered");
  // Q[stages], dO[stages], K, V, P, dS; on sm_90 the dQ stage follows (the
  // launcher sizes it: bwd_smem_bytes with dq_bulk).
  static constexpr int kSmemBytes = bwd_smem_bytes(kTiles, sizeof(T), D, false);
  static_assert(kSmemBytes == 2 * kQStages * QTile::kBytes + 2 * KTile::kBytes + 2 * PTile::kBytes, "layout");
  // The dbias kernel needs no P / dS tiles.
  static constexpr int kDbiasSmemBytes = 2 * QTile::kBytes + 2 * KTile::kBytes;
};

// Workspace layout, a pure function of (instances, T, S, H, dtype, segment ids);
// every segment 256-byte aligned relative to a base that is itself rounded up to
// 256 bytes inside the buffer (hence the extra 256 in the total).
//   counter : int          CTA tickets of the main kernel (zeroed per call)
//   sems    : int [I][nQ][W]  per (instance, Q tile, dQ warp): dQ contributions so far (zeroed)
//   dq_acc  : f32 [I][T_pad][D_pad]  the dQ accumulator (zeroed), unscaled; each
//             Q tile's block_m x D_pad floats in the order of BwdDqGrid
//   lse2    : f32 [I][T_pad]  the lse's hi (base 2, params.h), +inf for rows that get no gradient
//   lse2_lo : f32 [I][T_pad]  the lse's lo, 0 for those rows
//   delta   : f32 [I][T_pad]  rowsum(dO o O) - dlse, 0 for those rows
//   segments: the per-tile id ranges of segment ids (segment_tiles.h), at the tiles of the
//             kernel that runs (launch_backward): sized here for the general variant's, whose
//             BLOCK_N (64 for 16-bit D = 64 / 128) is the smallest of the kernels that take
//             ids, so the others' tables fit (BLOCK_M is common to all); none without ids
// counter and sems are contiguous: one memset clears them. dq_acc needs none: each Q tile's
// first dQ turn stores where the others add (bwd_dq.h), and the post-pass writes 0 for a tile
// no key tile visited (its first semaphore still 0).
struct BwdWorkspaceLayout {
  int64_t block_m, q_tiles, t_pad, d_pad;
  // [0, zero_bytes) is zeroed before the kernels run: the CTA counter at 0, the id tables'
  // kernel's counters at table_counters_off, the dQ semaphores from sems_off.
  static constexpr int64_t table_counters_off = 128;
  int64_t sems_off, dq_acc_off, lse2_off, lse2_lo_off, delta_off, segments_off, zero_bytes, total_bytes;

  static constexpr int64_t align(int64_t x) { return (x + 255) / 256 * 256; }

  static BwdWorkspaceLayout of(int64_t instances, int64_t seqlen_q, int64_t seqlen_k, int64_t head_dim,
                               int elem_bytes, bool has_segment_ids) {
    BwdWorkspaceLayout w;
    w.d_pad = bwd_padded_head_dim(head_dim);
    w.block_m = bwd_dq_grid(elem_bytes, static_cast<int>(w.d_pad)).block_m;
    w.q_tiles = (seqlen_q + w.block_m - 1) / w.block_m;
    w.t_pad = w.q_tiles * w.block_m;
    w.sems_off = 256;
    w.dq_acc_off = w.sems_off + align(instances * w.q_tiles * bwd_dq_grid(elem_bytes, static_cast<int>(w.d_pad)).warps * 4);
    w.lse2_off = w.dq_acc_off + align(instances * w.t_pad * w.d_pad * 4);
    w.zero_bytes = w.dq_acc_off;
    w.lse2_lo_off = w.lse2_off + align(instances * w.t_pad * 4);
    w.delta_off = w.lse2_lo_off + align(instances * w.t_pad * 4);
    w.segments_off = w.delta_off + align(instances * w.t_pad * 4);
    const int block_n = bwd_tiles(elem_bytes, static_cast<int>(w.d_pad), true).block_n;
    w.total_bytes = w.segments_off +
                    segment_tiles_bytes(has_segment_ids, instances, seqlen_q, seqlen_k, static_cast<int>(w.block_m),
                                        block_n) +
                    256;
    return w;
  }
};

// Launch-time values, computed once on the host (backward.cu); with_scale_operand below sets the
// scale's under kScaleOperand.
struct BwdRuntime {
  float score_mul;  // scale * log2 e
  float softcap2;   // log2 e * logits_soft_cap (primitives/score.h), 0 without one (general variant)
  float scale;
  float dv_scale;   // 1, or dropout's 1 / (1 - rate): dV = c (P o Z)^T dO
  bool bias_f32;    // bias / dbias are float32 rather than T
  // 16-byte-aligned rows (base, row and instance strides): cp.async / vector stores.
  bool q_vec, k_vec, v_vec, do_vec, dk_vec, dv_vec;

  // Workspace (see BwdWorkspaceLayout).
  int* counter;
#ifdef JAXFLASH_BWD_TIMELINE
  unsigned long long* timeline;  // timeline.h
#endif
  int* sems;
  float* dq_acc;
  float* lse2;
  float* lse2_lo;
  float* delta;
  int64_t q_tiles, t_pad, d_pad;
  BwdDqGrid dq;   // the accumulator's layout (the post-pass reads it)
  bool dq_bulk;   // sm_90+: dQ staged in shared memory and bulk-reduced
  bool general;   // the main kernel variant: bias, mask, dropout, score modifiers or unaligned q / k / v / dO rows
  bool sm90;      // the main kernel is the sm_90 (wgmma) one, bwd_sm90_kernel.h
  TmaOperand tma_q, tma_do;  // its producer's descriptors of q and dO (tma_encode.h), when sm90
  TmaOperand tma_k, tma_v;   // and of k and v, in key tiles
  int sms;                   // the device's SMs: the sm_90 kernel's persistent grid

  // The main kernel: one CTA per (kept instance, key tile of the variant's
  // BLOCK_N); it loops over the `kv_reduced` instances that share its dK / dV
  // (the axes where dk and dv have stride 0: a GQA group). The dbias kernel
  // (always the general variant) uses the same key tiles.
  uint32_t kv_reduce_mask;
  int64_t kv_kept, kv_reduced, k_tiles;
  int64_t tickets;       // kv_kept * k_tiles: the main kernel's work items (bwd_key_tile.h)
  // The sm_90 kernel loads K / V for each instance of a kept one's group, not once per key
  // tile: where k or v move along a reduced axis, or the key lengths do.
  bool kv_per_instance;
  int64_t ticket_group;  // kept instances per group of tickets (bwd_key_tile.h)
  bool keys_descend;     // key tiles may take tickets and dQ turns from the last down (bwd_key_tile.h)

  // The dbias kernel: outputs per dbias-kept instance, summed over the
  // `dbias_reduced` instances it is broadcast along, and over rows / columns
  // when dbias has a single row / column (row / col stride 0, T / S > 1).
  uint32_t dbias_reduce_mask;
  int64_t dbias_kept, dbias_reduced;
  bool dbias_one_row, dbias_one_col;

  // Segment ids: the id ranges of the main kernel's Q tiles (block_m) and key tiles (block_n:
  // the sm_90 kernel's or the general variant's), in the workspace; null tables without ids.
  SegmentTiles segments;
};

// The runtime a backward kernel computes instance `linear` with: the launch's, with the scale
// (dk's factor) and score_mul from that instance's scale under kScaleOperand (a traced scale:
// device memory, which the host cannot read without synchronising). A CTA reads it for the
// first instance it sums over: the scale is the same along the axes dk, dv and dbias sum over
// (check_gradient_layouts in decode.h). dq's factor is the postpass's, 1 then (params.h).
__device__ __forceinline__ BwdRuntime with_scale_operand(const AttentionParams& p, BwdRuntime rt, int64_t linear) {
  if (p.has(kScaleOperand)) {
    rt.scale = instance_scale(p, linear);
    rt.score_mul = rt.scale * kLog2e;
  }
  return rt;
}

// Whether the call modifies the scores in a way the sm_90 kernel runs in its copy for them
// (BwdSm90Config::kScoreMods): a logit soft-cap, ALiBi or segment ids.
inline bool has_score_mods(const AttentionParams& p) {
  return p.softcap > 0.f || p.has(kHasAlibi) || p.has(kHasSegmentIds);
}

// The instance axes (bits) along which an output is shared: stride 0, size > 1.
inline uint32_t shared_axes(const AttentionParams& p, const ArrayView& out) {
  uint32_t bits = 0;
  for (int d = 0; d < p.num_inst_dims; ++d)
    if (p.inst_size[d] > 1 && out.inst_stride[d] == 0) bits |= 1u << d;
  return bits;
}

// Number of instances along the axes in `mask` (reduced) or the others.
inline int64_t split_count(const AttentionParams& p, uint32_t mask, bool reduced) {
  int64_t n = 1;
  for (int d = 0; d < p.num_inst_dims; ++d)
    if (((mask >> d) & 1u) == static_cast<uint32_t>(reduced)) n *= p.inst_size[d];
  return n;
}

// The linear instance whose non-`mask` axes are numbered `kept` and `mask`
// axes `reduced` (row-major within each group), as in the CPU's InstanceSplit.
__device__ __forceinline__ int64_t compose_instance(const AttentionParams& p, uint32_t mask, int64_t kept,
                                                    int64_t reduced) {
  int64_t linear = 0, stride = 1;
#pragma unroll
  for (int d = kMaxInstanceDims - 1; d >= 0; --d) {
    if (d < p.num_inst_dims) {
      const int64_t n = p.inst_size[d];
      int64_t i;
      if ((mask >> d) & 1u) {
        const int64_t q = reduced / n;
        i = reduced - q * n;
        reduced = q;
      } else {
        const int64_t q = kept / n;
        i = kept - q * n;
        kept = q;
      }
      linear += i * stride;
      stride *= n;
    }
  }
  return linear;
}

}  // namespace jaxflash::gpu
