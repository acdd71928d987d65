// Validation, launch-time constants and the (dtype, head dim) dispatch of the
// forward pass. The kernels themselves are instantiated in generated
// translation units (cmake/cuda.cmake).
#include "forward.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "arch.h"
#include "instance.h"
#include "kernel_traits.h"
#include "timeline.h"
#include "primitives/positions.h"
#include "segment_tile_ranges.h"
#include "tma_encode.h"

namespace jaxflash::gpu {

// Defined in the generated fwd_<dtype>_d<D>.cu (3xTF32: fwd_f32x3_d<D>.cu; P whole:
// fwd_f32p_d<D>.cu; cmake/cuda.cmake).
template <class T, int D, F32Mma M = F32Mma::kTf32>
cudaError_t launch_forward_instance(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream);

namespace {

// JAXFLASH_FWD_NO_SM90 (defined for every translation unit) keeps the mma.sync
// kernels, to test them on a Hopper GPU.
#ifdef JAXFLASH_FWD_NO_SM90
constexpr bool kNoSm90 = true;
#else
constexpr bool kNoSm90 = false;
#endif

// A (query tile, key tile) shape: BLOCK_M x BLOCK_N.
struct TileShape {
  int block_m, block_n;
};

// Calls f(std::integral_constant<int, D>{}) for a head dim D the sm_90 kernel covers
// (tile_size.h's fwd_sm90_covers: 64, 128, 256) and returns its result.
template <class F>
auto with_sm90_head_dim(int64_t head_dim, F&& f) {
  if (head_dim == 64) return f(std::integral_constant<int, 64>{});
  if (head_dim == 128) return f(std::integral_constant<int, 128>{});
  return f(std::integral_constant<int, 256>{});
}

// The shape of the copy the launch picks (fwd_launch.h: the score modifiers' copy `mods`, with
// 160-key tiles where `wide`): its tiles, its shared memory, and whether O
// leaves through a buffer of its own (kSeparateO: by TMA stores, so o needs a descriptor).
struct Sm90Shape {
  TileShape tiles;
  int smem_bytes;
  bool separate_o;
};
Sm90Shape sm90_shape(int64_t head_dim, FwdMods mods, bool wide) {
  return with_sm90_head_dim(head_dim, [&](auto d) {
    constexpr int D = decltype(d)::value;
    return with_fwd_mods(mods, [&](auto m) {
      constexpr FwdMods M = decltype(m)::value;
      auto shape = [](auto tiles, int smem_bytes) {
        using Tiles = decltype(tiles);
        return Sm90Shape{{Tiles::kBlockM, Tiles::kBlockN}, smem_bytes, Tiles::kSeparateO};
      };
      if constexpr (fwd_sm90_has_wide_keys(D, M)) {
        if (wide) return shape(FwdSm90TileSize<D, M, true>{}, fwd_sm90_smem_bytes<D, M, true>());
      }
      return shape(FwdSm90TileSize<D, M>{}, fwd_sm90_smem_bytes<D, M>());
    });
  });
}

// Whether the sm_90 kernel runs this case (tile_size.h's fwd_sm90_covers,
// kernel_traits.h's fwd_sm90_case; a device that runs sm_90a code, enough shared
// memory), and its descriptors if so.
cudaError_t choose_sm90(const AttentionParams& p, FwdRuntime& rt, int device) {
  rt.sm90 = rt.sm90_wide_keys = false;
  if (kNoSm90 || !fwd_sm90_case(p, rt) || !fwd_sm90_covers(dtype_bytes(p.dtype), static_cast<int>(p.head_dim)))
    return cudaSuccess;
  bool runs = false;
  if (const cudaError_t err = runs_sm90a_code(device, &runs); err != cudaSuccess || !runs) return err;
  int smem_limit = 0;
  if (const cudaError_t err = cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      err != cudaSuccess)
    return err;
  const FwdMods mods = fwd_sm90_mods(p, rt);
  const int head_dim = static_cast<int>(p.head_dim);
  const bool wide = fwd_sm90_has_wide_keys(head_dim, mods) && fwd_sm90_wide_keys(head_dim, p.seqlen_k);
  const Sm90Shape shape = sm90_shape(p.head_dim, mods, wide);
  if (shape.smem_bytes > smem_limit) return cudaSuccess;
  rt.sm90_wide_keys = wide;
  // (float32 O, kOutputF32, leaves from registers; without a buffer of its own O is copied
  // out by the warps: no descriptor for o then.)
  const bool tma_o = shape.separate_o && !p.has(kOutputF32);
  rt.sm90 = encode_tma_operand(rt.tma_q, p, p.q, p.seqlen_q, shape.tiles.block_m) &&
            encode_tma_operand(rt.tma_k, p, p.k, p.seqlen_k, shape.tiles.block_n) &&
            encode_tma_operand(rt.tma_v, p, p.v, p.seqlen_k, shape.tiles.block_n) &&
            (!tma_o || encode_tma_operand(rt.tma_o, p, p.o, p.seqlen_q, kFwdSm90WarpRows));
  return cudaSuccess;
}

// Calls f(std::integral_constant<int, D>{}) for the head dim D the kernels are compiled for
// that covers head_dim (the next of 32, 64, 96, 128, 192, 256), and returns its result: the
// launch and the segment ids' tables pick the same instantiation.
template <class F>
auto with_padded_head_dim(int64_t head_dim, F&& f) {
  if (head_dim <= 32) return f(std::integral_constant<int, 32>{});
  if (head_dim <= 64) return f(std::integral_constant<int, 64>{});
  if (head_dim <= 96) return f(std::integral_constant<int, 96>{});
  if (head_dim <= 128) return f(std::integral_constant<int, 128>{});
  if (head_dim <= 192) return f(std::integral_constant<int, 192>{});
  return f(std::integral_constant<int, 256>{});
}

// The general variant's tiles (kernel_traits.h's FwdConfig) at the padded head dim the
// dispatch below picks: segment ids run there unless the sm_90 kernel does (whose tiles are
// at least as large, so that tables these size hold its tables too).
template <int kElemBytes>
TileShape general_tiles(int64_t head_dim) {
  return with_padded_head_dim(head_dim, [](auto d) {
    using Tiles = FwdTileSize<kElemBytes, decltype(d)::value, true>;
    return TileShape{Tiles::kBlockM, Tiles::kBlockN};
  });
}
TileShape general_tiles(int64_t head_dim, DType dtype) {
  return dtype_bytes(dtype) == 4 ? general_tiles<4>(head_dim) : general_tiles<2>(head_dim);
}

template <class T, F32Mma M = F32Mma::kTf32>
cudaError_t dispatch_head_dim(const AttentionParams& p, const FwdRuntime& rt, cudaStream_t stream) {
  return with_padded_head_dim(p.head_dim,
                              [&](auto d) { return launch_forward_instance<T, decltype(d)::value, M>(p, rt, stream); });
}

// The workspace: its counters at the first 16-byte aligned address (the persistent sm_90
// kernel's tile counter, then the segment id tables' kernel's: 16 bytes, which 32 cover at any
// alignment), zeroed by one memset first; then the segment ids' tables.
struct FwdCounters {
  unsigned tile;
  SegmentTableCounters tables;
};
static_assert(sizeof(FwdCounters) == 16);
constexpr int64_t kCounterBytes = 32;

}  // namespace

int64_t forward_workspace_bytes(int64_t num_instances, int64_t seqlen_q, int64_t seqlen_k, int64_t head_dim,
                                DType dtype, bool has_segment_ids) {
  const TileShape tiles = general_tiles(head_dim, dtype);
  return kCounterBytes +
         segment_tiles_bytes(has_segment_ids, num_instances, seqlen_q, seqlen_k, tiles.block_m, tiles.block_n);
}

#ifdef JAXFLASH_FWD_TIMELINE
unsigned long long*& fwd_timeline_buffer() {
  static unsigned long long* buffer = nullptr;
  return buffer;
}
#endif

cudaError_t launch_forward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  const int elem_bytes = dtype_bytes(p.dtype);
  if (elem_bytes == 0) return cudaErrorInvalidValue;
  // Positions are 32-bit in the kernel (see primitives/positions.h).
  if (p.head_dim < 0 || p.head_dim > 256 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.seqlen_q >= kMaxSeqLen ||
      p.seqlen_k >= kMaxSeqLen || p.diagonal_offset <= -kMaxSeqLen || p.diagonal_offset >= kMaxSeqLen)
    return cudaErrorInvalidValue;
  if (p.seqlen_q == 0 || p.num_instances() == 0) return cudaSuccess;  // nothing to write
  if (workspace == nullptr) return cudaErrorInvalidValue;
  // The kernel copies rows of q/k/v/o in contiguous chunks.
  if (p.head_dim > 1 && (p.q.col_stride != 1 || p.k.col_stride != 1 || p.v.col_stride != 1 || p.o.col_stride != 1))
    return cudaErrorInvalidValue;
  const bool has_bias = p.has(kHasBias), has_mask = p.has(kHasMask);
  if (has_bias && p.bias_dtype != p.dtype && p.bias_dtype != DType::kF32) return cudaErrorInvalidValue;
  // A flagged operand must be there whenever it could be read (zero-size
  // buffers arrive as null, and then nothing reads them).
  const bool any_key = p.seqlen_k > 0;
  if ((has_bias && any_key && p.bias.data == nullptr) || (has_mask && any_key && p.mask.data == nullptr) ||
      (p.has(kDropout) && p.seed.data == nullptr) ||
      (p.has(kHasQLens) && p.q_lens.data == nullptr) || (p.has(kHasKvLens) && p.kv_lens.data == nullptr) ||
      (p.has(kHasSegmentIds) && any_key && (p.q_segment_ids.data == nullptr || p.kv_segment_ids.data == nullptr)))
    return cudaErrorInvalidValue;

  FwdRuntime rt;
  rt.score_mul = p.scale * kLog2e;
  // The unfolded path takes the running max of raw scores, which commutes
  // with the scaling only for scale > 0 (and with no soft-cap between them);
  // a scale operand's sign is not known here (the kernel reads it:
  // with_scale_operand), so it is folded too. ALiBi's term is in base-2 units.
  rt.fold_scale = has_bias || p.has(kScaleOperand) || !(p.scale > 0.f) || p.softcap > 0.f || p.has(kHasAlibi);
  rt.softcap2 = p.softcap * kLog2e;
  rt.exp_scale = rt.fold_scale ? 1.f : rt.score_mul;
  rt.p_shift = p.dtype == DType::kF16 ? 0.f : probability_shift(p.seqlen_k);
  rt.out_scale = p.has(kDropout) ? p.keep_scale : 1.f;
  rt.bias_f32 = p.bias_dtype == DType::kF32;
  rt.q_vec = rows_aligned(p, p.q, elem_bytes);
  rt.k_vec = rows_aligned(p, p.k, elem_bytes);
  rt.v_vec = rows_aligned(p, p.v, elem_bytes);
  rt.o_vec = rows_aligned(p, p.o, p.has(kOutputF32) ? 4 : elem_bytes);
  FwdCounters* const counters =
      reinterpret_cast<FwdCounters*>((reinterpret_cast<uintptr_t>(workspace) + 15) / 16 * 16);
  rt.tile_counter = &counters->tile;
  char* const segment_scratch = static_cast<char*>(workspace) + kCounterBytes;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&rt.sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = choose_sm90(p, rt, device);
  if (err != cudaSuccess) return err;
  // The counters that the persistent kernel and the id tables' kernel take from (no host
  // synchronisation: zeroed on the stream).
  if ((rt.sm90 || p.has(kHasSegmentIds)) &&
      (err = cudaMemsetAsync(counters, 0, sizeof(FwdCounters), stream)) != cudaSuccess)
    return err;
  // The id ranges follow the tiles of the kernel that runs; the sm_90 kernel's walk also takes
  // the query tiles' key spans.
  const TileShape tiles =
      rt.sm90 ? sm90_shape(p.head_dim, fwd_sm90_mods(p, rt), rt.sm90_wide_keys).tiles
              : general_tiles(p.head_dim, p.dtype);
  if ((err = launch_segment_tables(p, tiles.block_m, tiles.block_n, segment_scratch, &counters->tables,
                                   rt.segments, stream, rt.sm90)) != cudaSuccess)
    return err;

#ifdef JAXFLASH_FWD_TIMELINE
  if (const cudaError_t e = zeroed_timeline(fwd_timeline_buffer(), kFtRowWords, stream); e != cudaSuccess) return e;
  rt.timeline = fwd_timeline_buffer();
#endif
  switch (p.dtype) {
    case DType::kF16: return dispatch_head_dim<__half>(p, rt, stream);
    case DType::kBF16: return dispatch_head_dim<__nv_bfloat16>(p, rt, stream);
    default:  // kF32 (dtype_bytes checked it)
      // (kOutputF32: the differentiated forward, whose P goes into P.V whole; mma.h's PvOps)
      return p.has(kExactF32)    ? dispatch_head_dim<float, F32Mma::k3xTf32>(p, rt, stream)
             : p.has(kOutputF32) ? dispatch_head_dim<float, F32Mma::kTf32WholeP>(p, rt, stream)
                                 : dispatch_head_dim<float>(p, rt, stream);
  }
}

}  // namespace jaxflash::gpu
