// Hopper's asynchronous data movement and the synchronisation around it
// (sm_90): transaction mbarriers, TMA tensor loads, named barriers and
// setmaxnreg, what the warp-specialised forward (fwd_sm90_kernel.h) is built
// from.
//
// A transaction mbarrier completes a phase when its expected arrivals have
// arrived *and* the bytes announced by arrive_expect_tx have landed; a TMA load
// names the mbarrier it counts its bytes against. Waiting is by phase parity:
// a fresh barrier is in phase 0, so waiting for parity 1 (the phase "before")
// returns at once, which is how a producer's first pass over empty buffers
// goes through without a release.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "ptx.h"

namespace jaxflash::gpu {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JF_SM90_ASYNC 1
#else
#define JF_SM90_ASYNC 0
#endif

__device__ __forceinline__ void mbar_init(uint64_t* bar, int arrivals) {
#if JF_SM90_ASYNC
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
#endif
}

// Makes the initialised barriers visible to the async proxy (the TMA unit
// arrives on them); a CTA barrier must follow before any thread uses them.
__device__ __forceinline__ void mbar_init_fence() {
#if JF_SM90_ASYNC
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// An arrival by the threads with `pred` set, the others passing by: a
// predicate rather than a branch, so that no divergent path lies between the
// warpgroup's MMAs (ptxas serialises wgmma around divergent code).
__device__ __forceinline__ void mbar_arrive_if(uint64_t* bar, bool pred) {
#if JF_SM90_ASYNC
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(smem_addr(bar)),
      "r"(static_cast<int>(pred))
      : "memory");
#endif
}

// One arrival, with release semantics (as every arrival here): what this thread
// wrote before it is visible to a thread whose wait sees the phase complete.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if JF_SM90_ASYNC
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// One arrival that also announces `bytes` of TMA transactions for this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if JF_SM90_ASYNC
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// Announces `bytes` of TMA transactions for the current phase without arriving: for a
// thread that issues the copies first and arrives later, after stores of its own that the
// arrival is to publish.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
#if JF_SM90_ASYNC
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// Blocks until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if JF_SM90_ASYNC
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

// Tile i's buffer of an S-buffer mbarrier pipeline and the parity of its use
// of it (the phase a consumer waits for on "full"; a producer waits for the
// other parity on "empty").
template <int S>
struct Stage {
  int index;
  uint32_t parity;
  __device__ __forceinline__ explicit Stage(uint32_t i) : index(static_cast<int>(i % S)), parity(i / S & 1u) {}
};

// One operand's TMA descriptor for the sm_90 kernels (tma_encode.h builds it on
// the host; the forward's q, k, v and o, the backward's q and dO): a tensor of rank 2 + n,
// dims (head dim, rows, then the n <= 3 instance axes with more than one element
// and a nonzero stride). Boxes of 64 columns (128 bytes, the swizzle's width) by
// a tile's rows. Tensor dim 2 + i of instance `linear` is at (linear /
// inst_div[i]) % inst_size[i] (1 and 1 past n: coordinate 0).
struct TmaOperand {
  CUtensorMap map;
  int rank;
  int64_t inst_div[3], inst_size[3];

  // In the width of `linear`'s type: the persistent forward's producer decodes every tile in
  // 24 registers and passes an int (its instances fit one: fwd_launch.h), the backward an int64_t.
  template <class Index>
  __device__ __forceinline__ void instance_coords(Index linear, int (&c)[3]) const {
#pragma unroll
    for (int i = 0; i < 3; ++i)
      c[i] = static_cast<int>(linear / static_cast<Index>(inst_div[i]) % static_cast<Index>(inst_size[i]));
  }
};

// A TMA load of one box of `map` at element coordinates c (innermost first)
// into shared memory at dst, its bytes counted against `bar`. R = the map's rank.
template <int R>
__device__ __forceinline__ void tma_load(const CUtensorMap* map, uint64_t* bar, void* dst, const int (&c)[R]) {
  static_assert(R >= 2 && R <= 5, "the ranks the forward's maps have");
#if JF_SM90_ASYNC
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  const uint32_t d = smem_addr(dst), b = smem_addr(bar);
  if constexpr (R == 2)
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(d),
        "l"(m), "r"(b), "r"(c[0]), "r"(c[1])
        : "memory");
  else if constexpr (R == 3)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(d),
        "l"(m), "r"(b), "r"(c[0]), "r"(c[1]), "r"(c[2])
        : "memory");
  else if constexpr (R == 4)
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(d),
        "l"(m), "r"(b), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3])
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(d),
        "l"(m), "r"(b), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4])
        : "memory");
#else
  (void)map, (void)bar, (void)dst, (void)c;
#endif
}

// One TMA box per 64-column block of a tile (a GmmaTile) whose rows start at
// `row`, of the instance at coordinates `inst` (TmaOperand::instance_coords).
template <class Tile>
__device__ __forceinline__ void tma_load_tile(const TmaOperand& op, const int (&inst)[3], uint64_t* bar,
                                              const Tile& tile, int row) {
#pragma unroll
  for (int b = 0; b < Tile::kCols / Tile::kBlockCols; ++b) {
    char* dst = tile.ptr + b * Tile::kBlockBytes;
    const int col = b * Tile::kBlockCols;
    switch (op.rank) {
      case 2: tma_load<2>(&op.map, bar, dst, {col, row}); break;
      case 3: tma_load<3>(&op.map, bar, dst, {col, row, inst[0]}); break;
      case 4: tma_load<4>(&op.map, bar, dst, {col, row, inst[0], inst[1]}); break;
      default: tma_load<5>(&op.map, bar, dst, {col, row, inst[0], inst[1], inst[2]}); break;
    }
  }
}

// A thread's bulk async-group (the TMA stores, dq_order.h's bulk reductions): the operations
// it issued since the last commit form one group, and the waits are for its groups.
__device__ __forceinline__ void bulk_commit() {
#if JF_SM90_ASYNC
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Until this thread's bulk operations are complete, their writes visible to it.
__device__ __forceinline__ void bulk_wait_all() {
#if JF_SM90_ASYNC
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}
// Until this thread's bulk operations have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_reads() {
#if JF_SM90_ASYNC
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

// A TMA store of one box of `map` at element coordinates c (innermost first) from shared
// memory at src, in this thread's bulk async-group (bulk_commit, then bulk_wait_reads
// before src is written again). Elements outside the tensor are not written.
template <int R>
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, const int (&c)[R]) {
  static_assert(R >= 2 && R <= 5, "the ranks the maps have");
#if JF_SM90_ASYNC
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  const uint32_t s = smem_addr(src);
  if constexpr (R == 2)
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(m), "r"(s),
                 "r"(c[0]), "r"(c[1])
                 : "memory");
  else if constexpr (R == 3)
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(m),
                 "r"(s), "r"(c[0]), "r"(c[1]), "r"(c[2])
                 : "memory");
  else if constexpr (R == 4)
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(m),
                 "r"(s), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3])
                 : "memory");
  else
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(m),
                 "r"(s), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4])
                 : "memory");
#else
  (void)map, (void)src, (void)c;
#endif
}

// tma_load_tile's inverse for a band of a tile's rows: rows [tile_row, + the map's box rows)
// of a GmmaTile (tile_row a multiple of 8, so the band starts on a swizzle atom) to the rows
// from `row` of instance `inst`, one box per 64-column block; rows and columns past the tensor
// are not written.
template <class Tile>
__device__ __forceinline__ void tma_store_rows(const TmaOperand& op, const int (&inst)[3], const Tile& tile,
                                               int tile_row, int row) {
#pragma unroll
  for (int b = 0; b < Tile::kCols / Tile::kBlockCols; ++b) {
    const char* src = tile.ptr + b * Tile::kBlockBytes + tile_row * 128;
    const int col = b * Tile::kBlockCols;
    switch (op.rank) {
      case 2: tma_store<2>(&op.map, src, {col, row}); break;
      case 3: tma_store<3>(&op.map, src, {col, row, inst[0]}); break;
      case 4: tma_store<4>(&op.map, src, {col, row, inst[0], inst[1]}); break;
      default: tma_store<5>(&op.map, src, {col, row, inst[0], inst[1], inst[2]}); break;
    }
  }
}

// A contiguous copy of `bytes` from global src to shared dst by the bulk copy
// engine (both 16-byte aligned, bytes a multiple of 16), counted against `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, uint64_t* bar) {
#if JF_SM90_ASYNC
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
#else
  (void)dst, (void)src, (void)bytes, (void)bar;
#endif
}

// Brings the tensor map into the TMA unit's cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
#if JF_SM90_ASYNC
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

// Orders this thread's generic-proxy accesses of the state space against
// async-proxy (bulk) ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if JF_SM90_ASYNC
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void fence_proxy_async_global() {
#if JF_SM90_ASYNC
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// Named barriers (ids 1..15; 0 is __syncthreads'): `threads` in all, the
// waiting ones arriving through sync, the signalling ones through arrive.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same barrier for threads that may reach it from different instructions (barrier.sync
// without .aligned): bar.sync is .aligned, which asks every thread that takes part to execute
// the same instruction (compute-sanitizer's synccheck reports "divergent threads" otherwise).
__device__ __forceinline__ void named_sync_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// setmaxnreg's balance for a CTA of `threads` threads, one per SM: the launch
// gives every thread launch_regs (__launch_bounds__: 65536 / threads in
// multiples of 8), and setmaxnreg only moves them between warpgroups: a
// consumer's increase waits until the producer's decrease has freed enough of
// the CTA's pool, so the two must balance (a producer kept at 32 beside two
// consumers of 240 hung the H100). The producer warpgroup keeps `kept`; the
// consumer threads share the rest, at most 240 each.
constexpr int launch_regs(int threads) { return 65536 / threads / 8 * 8; }
constexpr int consumer_regs(int threads, int consumer_threads, int kept) {
  const int share = (launch_regs(threads) * threads - 128 * kept) / consumer_threads / 8 * 8;
  return share < 240 ? share : 240;
}

// Moves registers between warpgroups: a producer gives up what it does not
// need and the consumers take it (all warps of a warpgroup execute it together).
template <int N>
__device__ __forceinline__ void regs_release() {
#if JF_SM90_ASYNC
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void regs_acquire() {
#if JF_SM90_ASYNC
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

}  // namespace jaxflash::gpu
