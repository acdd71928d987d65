// The backward pass: validation, the workspace, and four launches on one stream
//   memset   : ticket counter, dQ semaphores <- 0 (each dQ tile's first turn stores: bwd_dq.h)
//   pre-pass : per row, the lse's hi and lo (base 2 already) and delta (+inf, 0 / 0 for rows that get
//              no gradient); delta is the operand XLA computed as
//              rowsum(dO o O) - dlse from the float32 output
//   main     : dK, dV, and dQ accumulated in fp32 in a fixed order (bwd_kernel.h), and a
//              traced scale's dscale and ALiBi's dalibi when asked for; then dbias when asked
//              for (bwd_dbias.h)
//   post-pass: dq = scale * dQ accumulator, in dtype (0 for rows >= q_len)
// The main / dbias kernels are instantiated per (dtype, head dim) in
// generated instances (cmake/cuda.cmake); the pre / post passes depend on the dtype only.
#include "backward.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "arch.h"
#include "bwd_kernel_traits.h"
#include "instance.h"
#include "primitives/ptx.h"
#include "primitives/warp_gemm.h"
#include "segment_tile_ranges.h"
#include "timeline.h"
#include "tma_encode.h"

namespace jaxflash::gpu {

// Defined in the generated bwd_<dtype>_d<D>.cu (3xTF32: bwd_f32x3_d<D>.cu; cmake/cuda.cmake).
template <class T, int D, F32Mma M = F32Mma::kTf32>
cudaError_t launch_backward_instance(const AttentionParams& p, const BwdRuntime& rt, cudaStream_t stream);

namespace {

constexpr int kPassThreads = 256;  // per CTA of the pre / post passes

template <class T>
__device__ __forceinline__ T store_float(float x) {
  if constexpr (sizeof(T) == 4) return x;
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}

// One thread per workspace row (instance, t), t < t_pad. (One warp per row, as
// this pass was, took 120 us for 16k tokens x 16 heads on the H100: a warp's
// worth of index arithmetic for three floats.)
__global__ void __launch_bounds__(kPassThreads) backward_prepass(const __grid_constant__ AttentionParams p,
                                                                 const BwdRuntime rt) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kPassThreads + threadIdx.x;
  if (row >= p.num_instances() * rt.t_pad) return;
  const int64_t linear = row / rt.t_pad, t = row - linear * rt.t_pad;
  float lse2 = INFINITY, lse2_lo = 0.f, delta = 0.f;  // P = exp2(s - inf) = 0: no gradient from this row
  if (t < p.seqlen_q && t < instance_bounds(p, linear).q_len) {
    const InstanceIndex inst(p, linear);
    const float* lse = inst.origin<const float>(p, p.lse) + t * p.lse.row_stride;
    if (lse[0] != -INFINITY) {  // -inf: the row saw no key; its P are all 0 (and lo is not read)
      delta = inst.origin<const float>(p, p.delta)[t * p.delta.row_stride];
      lse2 = lse[0];
      lse2_lo = lse[p.lse.col_stride];
    }
  }
  rt.lse2[row] = lse2;
  rt.lse2_lo[row] = lse2_lo;
  rt.delta[row] = delta;
}

// Two adjacent columns of a dq row, from float32: one paired store where the
// host found every row's columns aligned to two elements (`pairs`), else two.
template <class T>
__device__ __forceinline__ void store_dq_pair(T* dst, float x0, float x1, bool both, bool pairs) {
  if constexpr (sizeof(T) == 2) {
    if (both && pairs) {
      if constexpr (std::is_same_v<T, __half>) *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(x0, x1);
      else *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(x0, x1);
      return;
    }
  } else if (both && pairs) {
    *reinterpret_cast<float2*>(dst) = make_float2(x0, x1);
    return;
  }
  dst[0] = store_float<T>(x0);
  if (both) dst[1] = store_float<T>(x1);
}

// One CTA per (instance, Q tile). The accumulator holds the tile as `chunks`
// blocks of block_m x chunk_cols floats in the main kernel's fragment order
// (bwd_dq.h, dq_frag_offset): warp w's part of a chunk is MF x NF fragments of
// 4 x 32 floats, element e of lane 4 g + q being row 16 mf + 8 (e / 2) + g,
// column 8 nf + 2 q + e % 2 of the warp's block. Each warp of this pass takes
// whole (chunk, warp) parts and walks their fragments: every load is 32
// consecutive floats, and each lane stores two adjacent columns of two rows.
// A part's loads all issue before its first store, kPostBatch fragments at a
// time: the compiler cannot move a load of the accumulator above a store to dq
// (they might alias), so loading and storing fragment by fragment left one
// fragment in flight per warp and the pass at 1.4 TB/s (167 us for 16k tokens x
// 2048 features, bf16, H100: 14% of the backward at N = 1k). (Before that, one
// warp per dq row decoding the fragment order per element took 255 us.) With
// `quads` (16-bit dq, rows 16-byte aligned, NF a multiple of 4), four
// fragments' pairs are regrouped in each quad (quad_transpose) and go out as
// one 16-byte store per lane: a quarter of the store instructions, each
// covering 64 contiguous bytes of a row instead of 16.
constexpr int kPostBatch = 8;  // the sm_90 grid's part: 1 x 8 fragments
static_assert(kPostBatch % 4 == 0, "whole groups of four fragments");

template <class T>
__global__ void __launch_bounds__(kPassThreads) backward_postpass(const __grid_constant__ AttentionParams p,
                                                                  const BwdRuntime rt, bool pairs, bool quads) {
  const int lane = threadIdx.x % 32, pass_warp = threadIdx.x / 32;
  const int64_t linear = blockIdx.x / rt.q_tiles, m0 = (blockIdx.x - linear * rt.q_tiles) * rt.dq.block_m;
  const int64_t q_len = instance_bounds(p, linear).q_len;
  const InstanceIndex inst(p, linear);
  // kScaleOperand: the scaled query's dq, in float32 and without the scale (params.h).
  const bool f32 = p.has(kScaleOperand);
  T* const dq = inst.origin<T>(p, p.dq);
  float* const dq_f32 = inst.origin<float>(p, p.dq);
  const float scale = f32 ? 1.f : rt.scale;
  const BwdDqGrid& g = rt.dq;
  const float* const tile = rt.dq_acc + (linear * rt.t_pad + m0) * rt.d_pad;
  // A tile no key tile visited took no dQ turn: its accumulator was never written (bwd_dq.h).
  const bool visited = rt.sems[static_cast<int64_t>(blockIdx.x) * rt.dq.warps] > 0;
  const int frags = g.mf * g.nf, part_floats = frags * 128;
  const int head_dim = static_cast<int>(p.head_dim);
  for (int part = pass_warp; part < g.chunks * g.warps; part += kPassThreads / 32) {
    const int chunk = part / g.warps, warp = part - chunk * g.warps;
    const int row0 = (warp / g.warps_n) * g.rows + lane / 4;
    const int cols0 = chunk * g.chunk_cols + (warp % g.warps_n) * g.cols;  // the warp block's first column
    const int col0 = cols0 + 2 * (lane % 4);
    const float* const src = tile + static_cast<int64_t>(part) * part_floats + lane;
    for (int f0 = 0; f0 < frags; f0 += kPostBatch) {
      float x[kPostBatch][4];
#pragma unroll
      for (int j = 0; j < kPostBatch; ++j) {
        const bool live = visited && f0 + j < frags;
#pragma unroll
        for (int e = 0; e < 4; ++e) x[j][e] = live ? __ldcs(src + (f0 + j) * 128 + 32 * e) : 0.f;  // read once
      }
#pragma unroll
      for (int j0 = 0; j0 < kPostBatch; j0 += 4) {  // four fragments of one m-fragment (quads)
        if (f0 + j0 >= frags) break;
        const int mf0 = (f0 + j0) / g.nf, group_col = cols0 + 8 * ((f0 + j0) - mf0 * g.nf);
        if constexpr (sizeof(T) == 2) {
          if (quads && group_col + 32 <= head_dim) {  // (warp-uniform: every lane shuffles)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int64_t t = m0 + row0 + 16 * mf0 + 8 * h;
              const float k = t < q_len ? scale : 0.f;  // rows past q_len: exactly 0
              uint32_t words[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) words[i] = pack2(x[j0 + i][2 * h] * k, x[j0 + i][2 * h + 1] * k, T{});
              const uint4 row_words = quad_transpose(words, lane);
              if (t < p.seqlen_q)
                *reinterpret_cast<uint4*>(dq + t * p.dq.row_stride + group_col + 8 * (lane % 4)) = row_words;
            }
            continue;
          }
        }
#pragma unroll
        for (int j = j0; j < j0 + 4; ++j) {
          if (f0 + j >= frags) break;
          const int mf = (f0 + j) / g.nf, col = col0 + 8 * ((f0 + j) - mf * g.nf);
          if (col >= head_dim) continue;
          const bool both = col + 1 < head_dim;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t t = m0 + row0 + 16 * mf + 8 * h;
            if (t >= p.seqlen_q) continue;
            const float k = t < q_len ? scale : 0.f;  // rows past q_len: exactly 0
            const int64_t at = t * p.dq.row_stride + col;
            if (f32) store_dq_pair(dq_f32 + at, x[j][2 * h] * k, x[j][2 * h + 1] * k, both, pairs);
            else store_dq_pair(dq + at, x[j][2 * h] * k, x[j][2 * h + 1] * k, both, pairs);
          }
        }
      }
    }
  }
}

template <class T, F32Mma M>
cudaError_t dispatch_head_dim(const AttentionParams& p, const BwdRuntime& rt, cudaStream_t stream) {
  switch (bwd_padded_head_dim(p.head_dim)) {
    case 32: return launch_backward_instance<T, 32, M>(p, rt, stream);
    case 64: return launch_backward_instance<T, 64, M>(p, rt, stream);
    case 96: return launch_backward_instance<T, 96, M>(p, rt, stream);
    case 128: return launch_backward_instance<T, 128, M>(p, rt, stream);
    case 192: return launch_backward_instance<T, 192, M>(p, rt, stream);
    default: return launch_backward_instance<T, 256, M>(p, rt, stream);
  }
}

template <class T, F32Mma M = F32Mma::kTf32>
cudaError_t launch_typed(const AttentionParams& p, const BwdRuntime& rt, cudaStream_t stream) {
  const int64_t instances = p.num_instances();
  const int64_t pre_blocks = (instances * rt.t_pad + kPassThreads - 1) / kPassThreads;
  const int64_t post_blocks = p.seqlen_q > 0 ? instances * rt.q_tiles : 0;
  if (pre_blocks > INT_MAX || post_blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  if (pre_blocks > 0) backward_prepass<<<static_cast<unsigned>(pre_blocks), kPassThreads, 0, stream>>>(p, rt);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if ((err = dispatch_head_dim<T, M>(p, rt, stream)) != cudaSuccess) return err;
  // dq's elements: float32 with a scale operand (the scaled query's gradient), else T.
  const int dq_bytes = p.has(kScaleOperand) ? 4 : static_cast<int>(sizeof(T));
  const bool pairs = rows_aligned(p, p.dq, dq_bytes, 2 * dq_bytes);
  const bool quads = dq_bytes == 2 && rt.dq.nf % 4 == 0 && rows_aligned(p, p.dq, 2, 16);
  if (post_blocks > 0)
    backward_postpass<T><<<static_cast<unsigned>(post_blocks), kPassThreads, 0, stream>>>(p, rt, pairs, quads);
  return cudaGetLastError();
}

}  // namespace

int64_t backward_workspace_bytes(int64_t num_instances, int64_t seqlen_q, int64_t seqlen_k, int64_t head_dim,
                                 DType dtype, bool has_segment_ids) {
  return BwdWorkspaceLayout::of(num_instances, seqlen_q, seqlen_k, head_dim, dtype_bytes(dtype), has_segment_ids)
      .total_bytes;
}

#ifdef JAXFLASH_BWD_TIMELINE
unsigned long long*& bwd_timeline_buffer() {
  static unsigned long long* buffer = nullptr;
  return buffer;
}
#endif

cudaError_t launch_backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  const int elem_bytes = dtype_bytes(p.dtype);
  if (elem_bytes == 0) return cudaErrorInvalidValue;
  if (p.num_inst_dims < 0 || p.num_inst_dims > kMaxInstanceDims) return cudaErrorInvalidValue;
  for (int d = 0; d < p.num_inst_dims; ++d)
    if (p.inst_size[d] < 1) return cudaErrorInvalidValue;
  if (p.head_dim < 0 || p.head_dim > 256 || p.seqlen_q < 0 || p.seqlen_k < 0) return cudaErrorInvalidValue;
  if (p.window_left < kUnbounded || p.window_right < kUnbounded) return cudaErrorInvalidValue;
  const int64_t instances = p.num_instances();
  if (instances == 0 || p.head_dim == 0 || (p.seqlen_q == 0 && p.seqlen_k == 0)) return cudaSuccess;
  if (workspace == nullptr) return cudaErrorInvalidValue;
  // Rows move in contiguous chunks.
  if (p.head_dim > 1) {
    for (const ArrayView* v : {&p.q, &p.k, &p.v, &p.d_o, &p.dq, &p.dk, &p.dv})
      if (v->col_stride != 1) return cudaErrorInvalidValue;
  }
  const bool has_bias = p.has(kHasBias), has_mask = p.has(kHasMask), want_dbias = p.has(kHasDbias);
  if (has_bias && p.bias_dtype != p.dtype && p.bias_dtype != DType::kF32) return cudaErrorInvalidValue;
  if (want_dbias && !has_bias) return cudaErrorInvalidValue;  // dbias needs the bias (it shapes P)
  // Every operand that can be read or written must be there (zero-size
  // buffers arrive as null, and then nothing touches them).
  const bool rows = p.seqlen_q > 0, keys = p.seqlen_k > 0;
  if ((rows && (!p.q.data || !p.lse.data || !p.delta.data || !p.d_o.data || !p.dq.data)) ||
      (keys && (!p.k.data || !p.v.data || !p.dk.data || !p.dv.data)) ||
      (rows && keys && ((has_bias && !p.bias.data) || (has_mask && !p.mask.data) || (want_dbias && !p.dbias.data))) ||
      (p.has(kHasQLens) && !p.q_lens.data) || (p.has(kHasKvLens) && !p.kv_lens.data) ||
      (p.has(kDropout) && !p.seed.data) ||
      (rows && keys && p.has(kHasSegmentIds) && (!p.q_segment_ids.data || !p.kv_segment_ids.data)) ||
      (p.has(kHasDscale) && (!p.has(kScaleOperand) || (keys && !p.dscale.data) ||
                             (rows && keys && !p.dscale_centre.data))) ||
      (p.has(kHasDalibi) && (!p.has(kHasAlibi) || (keys && !p.dalibi.data) ||
                             (rows && keys && !p.dalibi_centre.data))))
    return cudaErrorInvalidValue;
  // One writer per output element: dq and dalibi are per instance; dk, dv and dscale are shared
  // along the same axes (the ones a CTA loops over).
  const uint32_t kv_mask = shared_axes(p, p.dk);
  if (shared_axes(p, p.dq) != 0 || shared_axes(p, p.dv) != kv_mask ||
      (p.has(kHasDscale) && shared_axes(p, p.dscale) != kv_mask) ||
      (p.has(kHasDalibi) && shared_axes(p, p.dalibi) != 0))
    return cudaErrorInvalidValue;

  const BwdWorkspaceLayout w =
      BwdWorkspaceLayout::of(instances, p.seqlen_q, p.seqlen_k, p.head_dim, elem_bytes, p.has(kHasSegmentIds));
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(workspace) + 255) / 256 * 256);

  BwdRuntime rt{};
  rt.scale = p.scale;
  rt.dv_scale = p.has(kDropout) ? p.keep_scale : 1.f;
  rt.score_mul = p.scale * kLog2e;
  rt.softcap2 = p.softcap * kLog2e;
  rt.bias_f32 = p.bias_dtype == DType::kF32;
  rt.q_vec = rows_aligned(p, p.q, elem_bytes);
  rt.k_vec = rows_aligned(p, p.k, elem_bytes);
  rt.v_vec = rows_aligned(p, p.v, elem_bytes);
  rt.do_vec = rows_aligned(p, p.d_o, elem_bytes);
  rt.dk_vec = rows_aligned(p, p.dk, elem_bytes);
  rt.dv_vec = rows_aligned(p, p.dv, elem_bytes);
  rt.counter = reinterpret_cast<int*>(base);
#ifdef JAXFLASH_BWD_TIMELINE
  if (const cudaError_t e = zeroed_timeline(bwd_timeline_buffer(), kTlEvents, stream); e != cudaSuccess) return e;
  rt.timeline = bwd_timeline_buffer();
#endif
  rt.sems = reinterpret_cast<int*>(base + w.sems_off);
  rt.dq_acc = reinterpret_cast<float*>(base + w.dq_acc_off);
  rt.lse2 = reinterpret_cast<float*>(base + w.lse2_off);
  rt.lse2_lo = reinterpret_cast<float*>(base + w.lse2_lo_off);
  rt.delta = reinterpret_cast<float*>(base + w.delta_off);
  rt.q_tiles = w.q_tiles;
  rt.t_pad = w.t_pad;
  rt.d_pad = w.d_pad;
  // The kernels take the bulk-reduction path when built for sm_90+, which is
  // what runs on a device of compute capability 9+ (the build embeds sm_80 and
  // sm_90a code); it needs the staging buffer.
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
#ifdef JAXFLASH_BWD_NO_BULK
  rt.dq_bulk = false;
#else
  rt.dq_bulk = major >= 9;
#endif
  // The mma.sync kernels read bias, mask, the score modifiers (soft-cap, ALiBi, segment ids)
  // and dropout in their general variant only; the sm_90 kernel reads no bias or mask, and
  // dropout and the score modifiers each in a copy of its own (BwdSm90Config), not both at
  // once. A scale operand is read by the mma.sync kernels' general variant only
  // (with_scale_operand), and so is ALiBi's slope gradient (kHasDalibi, bwd_dalibi.h): the sm_90
  // kernel runs ALiBi but does not write dalibi, so a call that differentiates the slopes runs
  // the general variant on Hopper too.
  const bool score_mods = has_score_mods(p);
  const bool sm90_excluded = has_bias || has_mask || (score_mods && p.has(kDropout)) || p.has(kScaleOperand) ||
                             p.has(kHasDalibi) || !rt.q_vec || !rt.k_vec || !rt.v_vec || !rt.do_vec;
  rt.general = sm90_excluded || p.has(kDropout) || score_mods;
  // The fast variant's larger tiles can exceed a device's shared memory
  // (sm_86 / sm_89 have 99 KB per block); the general variant computes the
  // same with smaller ones. 1 KB of slack covers the kernel's static shared
  // memory.
  int smem_limit = 0;
  if ((err = cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess)
    return err;
  const int d_pad = static_cast<int>(w.d_pad);
  if (!rt.general && bwd_smem_bytes(bwd_tiles(elem_bytes, d_pad, false), elem_bytes, d_pad, rt.dq_bulk) + 1024 > smem_limit)
    rt.general = true;
  // The sm_90 kernels where they cover the case (bwd_tile_size.h) and the
  // device runs this build's sm_90a code.
  // JAXFLASH_BWD_NO_SM90 (defined for every translation unit) keeps the mma.sync kernels, to
  // test them on a Hopper GPU.
  // (Its dQ writer adds by bulk reduction, so JAXFLASH_BWD_NO_BULK excludes it too.)
  // (Its size counts the 1 KB of alignment; it has no static shared memory.)
  rt.sm90 = !sm90_excluded && rt.dq_bulk && bwd_sm90_covers(elem_bytes, d_pad) &&
            bwd_sm90_smem_bytes(d_pad) <= smem_limit;
#ifdef JAXFLASH_BWD_NO_SM90
  rt.sm90 = false;
#endif
  if (rt.sm90 && (err = runs_sm90a_code(device, &rt.sm90)) != cudaSuccess) return err;
  // Its producer warp loads Q and dO by TMA; where a descriptor cannot describe them
  // (tma_encode.h: more than three instance axes that move the operand, strides beyond
  // TMA's range), the mma.sync kernels run, as forward.cu's choose_sm90 does.
  // (No query rows: nothing to load, and the mma.sync kernel writes dK = dV = 0.)
  if (rt.sm90) {
    const int block_m = bwd_sm90_block_m(d_pad);
    rt.sm90 = encode_tma_operand(rt.tma_q, p, p.q, p.seqlen_q, block_m) &&
              encode_tma_operand(rt.tma_do, p, p.d_o, p.seqlen_q, block_m) &&
              encode_tma_operand(rt.tma_k, p, p.k, p.seqlen_k, kBwdSm90BlockN) &&
              encode_tma_operand(rt.tma_v, p, p.v, p.seqlen_k, kBwdSm90BlockN);
  }
  if (rt.sm90) rt.general = false;  // its tiles are the fast variant's (bwd_tile_size.h)
  rt.dq = rt.sm90 ? bwd_sm90_dq_grid(d_pad) : bwd_dq_grid(elem_bytes, d_pad);
  const BwdTiles tiles = bwd_tiles(elem_bytes, d_pad, rt.general);
  rt.k_tiles = (p.seqlen_k + tiles.block_n - 1) / tiles.block_n;
  rt.kv_reduce_mask = kv_mask;
  rt.kv_kept = split_count(p, kv_mask, false);
  rt.tickets = rt.kv_kept * rt.k_tiles;
  int sms = 0;
  if ((err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return err;
  rt.sms = sms;
  rt.ticket_group = std::clamp<int64_t>(sms / kBwdKeyTilesInFlight, 1, std::max<int64_t>(rt.kv_kept, 1));  // H100: 33
  rt.kv_reduced = split_count(p, kv_mask, true);
  for (int d = 0; d < p.num_inst_dims; ++d)
    if (kv_mask >> d & 1u)
      rt.kv_per_instance |= p.k.inst_stride[d] != 0 || p.v.inst_stride[d] != 0 ||
                            (p.kv_lens.data != nullptr && p.kv_lens.inst_stride[d] != 0);
  // Key tiles in descending order (bwd_key_tile.h) for causal-like bands (keys end at a
  // window's right edge), where a group's Q and dO fit in half of L2. Descending, the key
  // tiles of an instance in flight together sit at Q tiles far apart (the short last ones
  // come and go while the long first ones walk on), so each Q / dO tile is read again
  // from L2 only if the group's all stay there; ascending, they walk the Q tiles a step
  // apart. H100, bf16, 16k tokens (BENCHMARKS.md, 2026-11-26): descending everywhere took
  // causal N = 1k to 1.18 / 1.25 of ascending (D = 64 / 128; group Q + dO 8.6 / 17 MB), and
  // 4k to 0.95 / 0.89 (35 / 69 MB), 16k to 0.65 / 0.62 (all instances, 134 MB).
  // Under segment ids a key tile meets only its documents' query tiles, so what must fit is
  // the group's rows of the longest document, not of the whole row: the host cannot see the
  // ids, so the id tables' kernel checks every key tile's span of meeting query tiles on the
  // device, and the kernels descend unless one is longer (keys_descend, bwd_key_tile.h).
  // H200, 16 documents of 1k packed in a 16k row, causal, bf16, D = 128: fwd+bwd 1697 ->
  // 1253-1290 us, the time of the same documents as separate rows with segment ids.
  int l2_bytes = 0;
  if ((err = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device)) != cudaSuccess) return err;
  const int64_t group_row_bytes = rt.ticket_group * rt.kv_reduced * d_pad * elem_bytes * 2;  // Q + dO per row
  const int64_t rows_in_l2 = l2_bytes / 2 / group_row_bytes;
  const bool band = p.window_right != kUnbounded;
  rt.keys_descend = band && (p.seqlen_q <= rows_in_l2 || p.has(kHasSegmentIds));
  // The span check's limit in query tiles, where only the ids can decide (negative: no check).
  const int64_t max_q_span = band && p.seqlen_q > rows_in_l2 && p.has(kHasSegmentIds) ? rows_in_l2 / tiles.block_m : -1;
  rt.dbias_reduce_mask = want_dbias ? shared_axes(p, p.dbias) : 0u;
  rt.dbias_kept = split_count(p, rt.dbias_reduce_mask, false);
  rt.dbias_reduced = split_count(p, rt.dbias_reduce_mask, true);
  rt.dbias_one_row = want_dbias && p.seqlen_q > 1 && p.dbias.row_stride == 0;
  rt.dbias_one_col = want_dbias && p.seqlen_k > 1 && p.dbias.col_stride == 0;
  // The id ranges follow the tiles of the main kernel that runs: the sm_90 kernel's (BLOCK_N
  // 128) or the general variant's (BwdWorkspaceLayout sizes the tables for the latter, the
  // larger).
  // The zeroed words first (the CTA counter, the dQ semaphores, the id tables' kernel's
  // counters), before every kernel that takes from them.
  if ((err = cudaMemsetAsync(base, 0, static_cast<size_t>(w.zero_bytes), stream)) != cudaSuccess ||
      (err = launch_segment_tables(p, tiles.block_m, tiles.block_n, base + w.segments_off,
                                   reinterpret_cast<SegmentTableCounters*>(base + w.table_counters_off),
                                   rt.segments, stream, false, max_q_span)) != cudaSuccess)
    return err;

  switch (p.dtype) {
    case DType::kF16: return launch_typed<__half>(p, rt, stream);
    case DType::kBF16: return launch_typed<__nv_bfloat16>(p, rt, stream);
    default:  // kF32 (dtype_bytes checked it)
      return p.has(kExactF32) ? launch_typed<float, F32Mma::k3xTf32>(p, rt, stream)
                              : launch_typed<float>(p, rt, stream);
  }
}

}  // namespace jaxflash::gpu
