// The one table of backward tile sizes and warp layouts, by element size and
// padded head dim. Read by the kernels (bwd_kernel_traits.h) and by the host
// (backward.cu: the workspace layout depends on BLOCK_M), so it is a constexpr
// function usable on both sides.
//
// One CTA owns BLOCK_N keys (its dK / dV rows) and walks BLOCK_M-row Q tiles.
// Per Q tile it runs five GEMMs, each with its own warp grid:
//   S  = Q K^T, dP = dO V^T  : BLOCK_M x BLOCK_N, warps s_warps_m x (warps / s_warps_m)
//   dV += P^T dO, dK += dS^T Q: BLOCK_N x D,       warps kv_warps_m x (warps / kv_warps_m)
//   dQ  = dS K               : BLOCK_M x D,       warps q_warps_m x (warps / q_warps_m)
// P and dS go through shared memory between the first pair and the rest, so
// the grids are independent. Shared memory = (2 q_stages BLOCK_M + 2 BLOCK_N)
// x D + 2 BLOCK_M x BLOCK_N elements (Q and dO per stage, K, V, P, dS).
//
// Every operand of the five GEMMs comes from shared memory, so the warp tile
// sets the shared-memory traffic per MMA: larger warp tiles reuse each
// fragment more. That is why the 16-bit D = 64 / 128 fast variants take
// 128-key tiles (warp tiles 32 x 32 for S / dP / dQ and 32 x 64 for dK / dV,
// FlashAttention-2's shapes): on an H100, D = 128 went from 128 to 183 TFLOP/s
// (N = 4k) against 64 x 64 tiles, and D = 64 from 138 to 168 with 128 x 128.
// Both spill some registers at sm_90 (about 100 words, outside the GEMMs'
// inner steps), as does 16-bit D = 256 (24 words); the other rows compile
// without spills at 255 registers (8 warps, one CTA per SM). Double-buffered Q / dO (q_stages = 2) loads the next Q tile during the
// whole current one. The general variant (bias / mask / unaligned rows) needs
// registers for those and keeps 64-key tiles; it shares BLOCK_M and the dQ
// grid with the fast one (the workspace layout). fp32 (tf32) tiles are twice
// as large per element, so BLOCK_M and then BLOCK_N shrink instead.
//
// Shared memory: the tiles, plus on sm_90 a BLOCK_M x D/q_chunks fp32 stage
// for the dQ bulk reduction. The fast D = 64 / 128 rows need 160 KB (sm_80)
// or 192 KB (sm_90); where a device has less (sm_86 / sm_89: 99 KB) the host
// runs the general variant instead (backward.cu). Without the stage, the
// general variant up to D = 128 and fp32 up to 64 fits 99 KB; D >= 192 (and
// fp32 D >= 96) need sm_80 / sm_90 shared memory.
//
//   elem  D    BLOCK_M BLOCK_N stages  tiles  +sm_90 stage
//   16b   32      64     128     1     56 KB   8 KB   (general variant: 64 x 64, 32 KB)
//   16b   64     128     128     2    160 KB  32 KB   (general variant: 128 x 64, 80 KB)
//   16b   96      64      64     1     64 KB  24 KB
//   16b  128      64     128     2    160 KB  32 KB   (general variant: 64 x 64, 80 KB)
//   16b  192      64      64     1    112 KB  24 KB   (dQ in 2 column chunks)
//   16b  256      64      64     1    144 KB  32 KB   (dQ in 2 column chunks)
//   f32   32      64      64     1     64 KB   8 KB
//   f32   64      64      64     1     96 KB  16 KB
//   f32   96      32      64     1     88 KB  12 KB
//   f32  128      32      64     1    112 KB  16 KB
//   f32  192      32      32     1    104 KB  24 KB
//   f32  256      32      32     1    136 KB  32 KB
#pragma once

namespace jaxflash::gpu {

struct BwdTiles {
  int block_m;     // query rows per tile (also the dQ accumulator's row padding)
  int block_n;     // keys per CTA
  int warps;
  int s_warps_m;   // warp rows of the S / dP grid
  int kv_warps_m;  // warp rows of the dK / dV grid
  int q_warps_m;   // warp rows of the dQ grid
  int q_chunks;    // the dQ GEMM runs in this many column chunks (registers)
  int min_blocks;  // __launch_bounds__ minimum CTAs per SM
  int q_stages = 1;  // Q / dO buffers: 2 loads the next Q tile during the whole current one
};

// `general`: the variant with bias / mask / unaligned rows (see
// bwd_kernel_traits.h), which needs registers of its own: at 16-bit D = 32,
// 64 and 128 it takes BLOCK_N = 64 where the fast variant takes 128.
// Both variants share BLOCK_M and the dQ grid (the workspace layout).
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr BwdTiles bwd_tiles(int elem_bytes, int d, bool general) {
  if (elem_bytes == 2) {
    switch (d) {
      case 32: return general ? BwdTiles{64, 64, 8, 4, 4, 4, 1, 1} : BwdTiles{64, 128, 8, 2, 8, 4, 1, 1};
      case 64: return general ? BwdTiles{128, 64, 8, 4, 4, 4, 1, 1} : BwdTiles{128, 128, 8, 4, 4, 4, 1, 1, 2};
      case 96: return {64, 64, 8, 4, 4, 4, 1, 1};
      case 128: return general ? BwdTiles{64, 64, 8, 4, 4, 2, 1, 1} : BwdTiles{64, 128, 8, 2, 4, 2, 1, 1, 2};
      case 192: return {64, 64, 8, 4, 4, 4, 2, 1};
      default: return {64, 64, 8, 4, 4, 4, 2, 1};  // 256
    }
  }
  switch (d) {
    case 32: return {64, 64, 8, 4, 4, 4, 1, 1};
    case 64: return {64, 64, 8, 4, 4, 4, 1, 1};
    case 96: return {32, 64, 8, 2, 4, 2, 1, 1};
    case 128: return {32, 64, 8, 2, 4, 2, 1, 1};
    case 192: return {32, 32, 8, 2, 2, 2, 1, 1};
    default: return {32, 32, 8, 2, 2, 2, 1, 1};  // 256
  }
}

// The dQ warp grid, which also fixes the layout of the dQ accumulator in the
// workspace: per (instance, Q tile, column chunk) one contiguous block of
// block_m x chunk_cols floats in MMA-fragment order (see bwd_kernel.h), so the
// kernel moves it with one bulk reduction and the post-pass un-permutes it.
struct BwdDqGrid {
  int block_m, chunks, chunk_cols;  // the tile is chunks x (block_m x chunk_cols)
  int warps_n, rows, cols, mf, nf;  // warp (wm, wn) owns rows [wm rows, +rows) x cols [wn cols, +cols)
  int warps;                        // each has its own dQ semaphore per Q tile
};

#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr BwdDqGrid bwd_dq_grid(int elem_bytes, int d) {
  const BwdTiles t = bwd_tiles(elem_bytes, d, false);
  const int warps_n = t.warps / t.q_warps_m, rows = t.block_m / t.q_warps_m, chunk_cols = d / t.q_chunks;
  const int cols = chunk_cols / warps_n;
  return {t.block_m, t.q_chunks, chunk_cols, warps_n, rows, cols, rows / 16, cols / 8, t.warps};
}

// Dynamic shared memory of the main kernel: Q and dO (q_stages each), K, V,
// P and dS, plus on sm_90 the fp32 stage of one dQ chunk for the bulk
// reduction. The host compares it with the device's limit (backward.cu).
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int bwd_smem_bytes(const BwdTiles& t, int elem_bytes, int d, bool dq_bulk) {
  const int tiles = (2 * t.q_stages * t.block_m + 2 * t.block_n) * d * elem_bytes + 2 * t.block_m * t.block_n * elem_bytes;
  return tiles + (dq_bulk ? t.block_m * (d / t.q_chunks) * 4 : 0);
}

// The CTA schedule (bwd_key_tile.h): tickets run through groups of instances,
// so that about this many key tiles of each instance are in flight at once:
// the SM count / kBwdKeyTilesInFlight instances' Q and dO, which every key
// tile of the instance reads in full, then stay in L2. Taking instances fastest
// instead (one group of all) left 1-2 key tiles per instance in flight once
// there were more instances than SMs, and the CTAs streamed Q / dO from
// memory. H100, sm_90 kernel, bf16, 16k tokens (at N = 4k: 64 instances),
// bwd_selftest bench-only, groups of 8 / 16 / 32 instances against all
// (BENCHMARKS.md, 2026-11-25): without causal masking 8, 16 and 32 all gain
// (N = 4k D = 64 229 -> 341-350 TFLOP/s, D = 128 348 -> 398-406; N = 1k
// +27-39%); with it the larger groups gain most (32: N = 4k D = 64 198 -> 261,
// N = 1k D = 128 126 -> 156; 8: 229 and 138), shorter dQ turn chains between
// key tiles started together. N = 16k (16 instances: one group) unchanged.
// 4 in flight: groups of 33 on 132 SMs (measured: 32).
constexpr int kBwdKeyTilesInFlight = 4;

// ---- The sm_90 family (bwd_sm90_kernel.h: wgmma) ----
//
// 16-bit D = 64 and 128 without bias or mask on compute capability 9.0
// (the fast variant's cases, and dropout or the score modifiers: soft-cap,
// ALiBi, segment ids). A CTA is two warpgroups and owns 128 keys, 64 per
// warpgroup (the M of its S^T / dP^T / dK / dV products); a Q tile is
// BLOCK_M rows, the same as the mma.sync kernels' so the two families share
// the workspace layout. dQ = dS K (BLOCK_M x D) is split between the
// warpgroups by rows when BLOCK_M = 128, by columns when D = 128; every warp
// then owns a 16 x 64 block of it, which sets the accumulator's layout.
//
//   D    BLOCK_M  Q, dO (x2 stages)  K, V    dS^T   dQ stages (x2)  total
//   64     128         64 KB         32 KB   32 KB       64 KB      193 KB
//   128     64         64 KB         64 KB   16 KB       64 KB      209 KB
//
// Registers per consumer thread: dK, dV (2 x D / 2) + S^T, dP^T (2 x
// BLOCK_M / 2) = 192 fp32 at both sizes, under the 240 that setmaxnreg gives
// the two consumer warpgroups beside the dQ writer's.
constexpr int kBwdSm90BlockN = 128;

#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr bool bwd_sm90_covers(int elem_bytes, int d) { return elem_bytes == 2 && (d == 64 || d == 128); }

#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int bwd_sm90_block_m(int d) { return d == 64 ? 128 : 64; }

// The dQ accumulator's layout (see BwdDqGrid): warp blocks of 16 x 64.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr BwdDqGrid bwd_sm90_dq_grid(int d) {
  return {bwd_sm90_block_m(d), 1, d, d / 64, 16, 64, 1, 8, 8};
}

// dS^T's buffers: two where they fit beside the rest (D = 128: 232112 of the 232448 bytes
// an sm_90 block may have), so that a tile's dS^T stores need not wait for the other
// warpgroup's dQ product of the previous tile, which reads the other buffer (one barrier
// per Q tile instead of two); one at D = 64, whose 32 KB dS^T tiles would not fit twice.
// With a Q tile's last dK product behind its dQ product at both head dims (dQ goes to the
// writers while dK computes: FlashAttention-3's order) and two dQ writers: H200, kernel alone
// against main (5731eac), 2 rounds, D = 128 1.05-1.08x in every cell, D = 64 0.98-1.02x
// (BENCHMARKS.md, 2026-11-28 evening). With one writer the same order lost 7% at D = 128
// N = 4k: the writer's rate was the bound (docs/DESIGN.md).
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int bwd_sm90_ds_stages(int d) { return d == 128 ? 2 : 1; }

// Dynamic shared memory: the tiles (dS^T's bwd_sm90_ds_stages), the per-stage row statistics (lse2, delta
// and a word per row: the dropout's row key or the query's segment id), the
// two dQ stages, their four mbarriers and two 16-byte turns (DqTurn), the loads'
// ten mbarriers (the Q-tile stages' four, K / V's two, the item slots' four) and
// the two 16-byte item slots and the stages' two 16-byte plans (bwd_sm90_loads.h), and 1 KB to
// align the tiles to 1024. (At D = 128 that leaves 304 bytes of the H100's 227 KB.)
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int bwd_sm90_smem_bytes(int d) {
  const int bm = bwd_sm90_block_m(d), bn = kBwdSm90BlockN;
  return 2 * 2 * bm * d * 2 + 2 * bn * d * 2 + bwd_sm90_ds_stages(d) * bn * bm * 2 + 2 * 3 * bm * 4 + 2 * bm * d * 4 + 4 * 8 + 2 * 16 + 10 * 8 + 2 * 16 + 2 * 16 + 1024;
}

static_assert(bwd_sm90_block_m(64) == bwd_tiles(2, 64, false).block_m &&
                  bwd_sm90_block_m(128) == bwd_tiles(2, 128, false).block_m &&
                  bwd_tiles(2, 64, false).block_n == kBwdSm90BlockN && bwd_tiles(2, 128, false).block_n == kBwdSm90BlockN &&
                  bwd_sm90_dq_grid(64).warps == bwd_dq_grid(2, 64).warps &&
                  bwd_sm90_dq_grid(128).warps == bwd_dq_grid(2, 128).warps,
              "the families share the workspace layout (BLOCK_M, dQ semaphores per tile) and key tiles");

// The padded head dim a kernel instantiation is compiled for.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int bwd_padded_head_dim(long long h) {
  return h <= 32 ? 32 : h <= 64 ? 64 : h <= 96 ? 96 : h <= 128 ? 128 : h <= 192 ? 192 : 256;
}

}  // namespace jaxflash::gpu
