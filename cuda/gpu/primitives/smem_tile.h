// A ROWS x COLS tile of T in shared memory, stored in 16-byte chunks with an
// XOR swizzle, and the copies between it and a strided global matrix.
//
// Why the swizzle: ldmatrix (and the fp32 path's scalar loads) read one 16-byte
// chunk from each of 8 consecutive rows at the same logical column. With a
// plain row-major layout and a row pitch that is a multiple of 128 bytes those
// 8 chunks fall in the same 4 banks (8-way conflict). XOR-ing the chunk index
// with bits of the row index spreads the 8 rows over all 8 bank groups, for
// every pitch this kernel uses; it also keeps cp.async stores conflict-free.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ptx.h"

namespace jaxflash::gpu {

template <class T, int ROWS, int COLS>
struct SmemTile {
  using Elem = T;
  static constexpr int kRows = ROWS;
  static constexpr int kCols = COLS;
  static constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));
  static constexpr int kChunksPerRow = COLS / kChunkElems;
  static constexpr int kBytes = ROWS * COLS * static_cast<int>(sizeof(T));
  static_assert(COLS % kChunkElems == 0, "rows are whole 16-byte chunks");
  // Pitch of 8k chunks: a row spans whole 128-byte lines, so XOR the chunk with
  // row % 8. Pitch of 4 (mod 8) chunks (64 or 192 bytes): two consecutive rows
  // share a line, so row bit 0 already separates them and bits 1..2 pick among
  // the 4 chunk positions.
  static_assert(kChunksPerRow % 4 == 0, "row pitch must be a multiple of 64 bytes");

  char* ptr;  // 128-byte aligned

  __device__ __forceinline__ static int swizzle(int row) {
    return kChunksPerRow % 8 == 0 ? (row & 7) : ((row >> 1) & 3);
  }
  __device__ __forceinline__ static int chunk_offset(int row, int chunk) {
    return (row * kChunksPerRow + (chunk ^ swizzle(row))) * 16;
  }
  // Byte offset of element (row, col).
  __device__ __forceinline__ static int offset(int row, int col) {
    return chunk_offset(row, col / kChunkElems) + (col % kChunkElems) * static_cast<int>(sizeof(T));
  }
  __device__ __forceinline__ uint32_t saddr(int row, int col) const { return smem_addr(ptr + offset(row, col)); }
  template <class U>
  __device__ __forceinline__ U& at(int row, int col) const {
    return *reinterpret_cast<U*>(ptr + offset(row, col));
  }

  // ---- Fragment loads at compile-time offsets from one per-lane position ----
  //
  // A warp GEMM loads every fragment of its block from offsets (DROW, DCOL)
  // of one lane position (row, col) that it knows only at run time. Computing
  // each swizzled address from scratch costs ~8 integer instructions per
  // ldmatrix, on the path that feeds the tensor cores. But when DROW is a
  // multiple of 8 the row's swizzle is unchanged, and when the chunk offset
  // has no bit inside the swizzle field in common with the position's chunk
  // index, adding it commutes with the XOR:
  //   addr(row + DROW, chunk + dc) = (addr(row, chunk) ^ (dc & mask) * 16)
  //                                  + (dc & ~mask) * 16 + DROW * pitch,
  // one LOP3 (shared by every load with the same dc & mask) plus the
  // instruction's immediate. That needs the tile's base and pitch to have no
  // bits inside the field: tiles start 128-byte aligned and the pitch is a
  // multiple of 128 bytes (or of 64 with the 2-bit field).
  static constexpr int kSwizzleMask = kChunksPerRow % 8 == 0 ? 7 : 3;

  // The swizzle-field bits a position's chunk index can have when the
  // position is a lane offset of `lane_bits` plus a run-time origin that is a
  // multiple of `origin_cols` columns.
  __host__ __device__ static constexpr int chunk_bits(int lane_bits, int origin_cols) {
    if (origin_cols % kChunkElems != 0) return kSwizzleMask;
    const int chunks = origin_cols / kChunkElems;
    const int align = chunks & -chunks;  // the largest power of 2 dividing it
    return (lane_bits | ~(align - 1)) & kSwizzleMask;
  }

  struct Cursor {
    uint32_t addr;  // shared address of (row, col)
    int row, col;   // read only by offsets the XOR form cannot take
  };
  __device__ __forceinline__ Cursor cursor(int row, int col) const { return {saddr(row, col), row, col}; }

  // Shared address of (c.row + DROW, c.col + DCOL), c's chunk index having
  // at most the swizzle-field bits kChunkBits (chunk_bits).
  template <int DROW, int DCOL, int kChunkBits>
  __device__ __forceinline__ uint32_t addr_at(const Cursor& c) const {
    constexpr int dc = DCOL / kChunkElems;
    if constexpr (DROW % 8 == 0 && DCOL % kChunkElems == 0 && (dc & kSwizzleMask & kChunkBits) == 0)
      return (c.addr ^ static_cast<uint32_t>((dc & kSwizzleMask) * 16)) + (dc & ~kSwizzleMask) * 16 +
             DROW * kChunksPerRow * 16;
    else
      return saddr(c.row + DROW, c.col + DCOL);
  }
};

// A ROWS x COLS tile of a 16-bit type in the layout the Hopper tensor cores
// (wgmma) read through a shared-memory descriptor (primitives/wgmma.h): the
// 128-byte swizzle. Columns are split into blocks of 64 elements (128 bytes),
// each block stored as ROWS rows of 128 bytes, block after block; inside a
// block, the 16-byte chunk c of row r sits at chunk position c ^ (r % 8). An
// 8-row group (1024 bytes) is the swizzle's repeating unit, so the tile must
// start 1024-byte aligned. For COLS = 64 this is SmemTile's layout; wider
// tiles differ (SmemTile keeps a row contiguous). The same bytes serve as a
// K-major operand (the contiguous columns are the GEMM's k) or an MN-major
// one (they are its m or n); only the descriptor differs.
template <class T, int ROWS, int COLS>
struct GmmaTile {
  using Elem = T;
  static_assert(sizeof(T) == 2, "16-bit operands");
  static constexpr int kRows = ROWS;
  static constexpr int kCols = COLS;
  static constexpr int kChunkElems = 8;
  static constexpr int kChunksPerRow = COLS / kChunkElems;
  static constexpr int kBlockCols = 64;               // one 128-byte swizzle row
  static constexpr int kBlockBytes = ROWS * 128;      // one column block
  static constexpr int kBytes = ROWS * COLS * 2;
  static_assert(ROWS % 8 == 0 && COLS % kBlockCols == 0, "whole 8-row x 64-column swizzle atoms");

  char* ptr;  // 1024-byte aligned

  __host__ __device__ static constexpr int chunk_offset(int row, int chunk) {
    return (chunk / 8) * kBlockBytes + row * 128 + ((chunk % 8) ^ (row % 8)) * 16;
  }
  __device__ __forceinline__ static int offset(int row, int col) {
    return chunk_offset(row, col / kChunkElems) + (col % kChunkElems) * 2;
  }
  template <class U>
  __device__ __forceinline__ U& at(int row, int col) const {
    return *reinterpret_cast<U*>(ptr + offset(row, col));
  }

  // Addresses at offsets from one lane position that ptxas folds to an XOR and an
  // immediate: the shared address of (row, col), col < 8, with the row's swizzle
  // phase row % 8 added in bits 4-6, where the row's own address (a multiple of
  // 128 bytes from a 1024-aligned base) has none. Then (row + drow, col + dcol),
  // drow and dcol multiples of 8 (the phase unchanged, whole chunks), is
  // origin_at(origin, drow, dcol): chunk c = dcol / 8 lands at position
  // (c % 8) ^ (row % 8) of its column block. (SmemTile's Cursor, for this layout.)
  __device__ __forceinline__ uint32_t origin(int row, int col) const {
    return smem_addr(ptr) + row * 128 + (row % 8) * 16 + col * 2;
  }
  __device__ __forceinline__ static uint32_t origin_at(uint32_t origin, int drow, int dcol) {
    const int c = dcol / kChunkElems;
    return (origin ^ static_cast<uint32_t>((c % 8) * 16)) + (c / 8) * kBlockBytes + drow * 128;
  }
};

// Raw bits of one element: loads and stores move bits, never convert.
template <class T>
using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;

// Elements [0, n) of g, zero beyond, as one 16-byte chunk: the synchronous
// fallback for rows that are not 16-byte aligned.
template <class T>
__device__ __forceinline__ uint4 load_chunk_bits(const T* g, int n) {
  const Bits<T>* b = reinterpret_cast<const Bits<T>*>(g);
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (sizeof(T) == 4) {
      w[j] = j < n ? b[j] : 0u;
    } else {
      const uint32_t lo = 2 * j < n ? b[2 * j] : 0u, hi = 2 * j + 1 < n ? b[2 * j + 1] : 0u;
      w[j] = lo | hi << 16;
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Thread layout of a whole-tile copy: kPerRow threads share a row, each
// taking every kPerRow-th chunk of it, and a pass covers kThreads / kPerRow
// rows. kPerRow divides both the row's chunk count and the thread count, so a
// thread keeps one chunk column and one row pointer per pass (cheap addresses,
// few registers) for every pitch, 12 or 24 chunks included.
template <int kThreads, int kChunksPerRow>
struct CopyLayout {
  static constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }
  static constexpr int kPerRow = gcd(kChunksPerRow, kThreads);
  static constexpr int kRowsPerPass = kThreads / kPerRow;
  static constexpr int kChunksPerThread = kChunksPerRow / kPerRow;
};

// Global matrix `src` (row pitch `row_stride` elements, unit column stride) ->
// tile (a SmemTile or a GmmaTile). Rows >= valid_rows and columns >= valid_cols are zero-filled and never
// read. `vec` says the 16-byte chunks of src are 16-byte aligned (base, row and
// instance strides); then the copy is asynchronous (cp.async, to be committed
// by the caller), otherwise it falls back to element loads, synchronous.
template <int kThreads, class Tile>
__device__ __forceinline__ void load_tile(const Tile& tile, const typename Tile::Elem* src, int64_t row_stride,
                                          int valid_rows, int valid_cols, bool vec, int tid) {
  using T = typename Tile::Elem;
  constexpr int ROWS = Tile::kRows, COLS = Tile::kCols;
  using L = CopyLayout<kThreads, Tile::kChunksPerRow>;
  constexpr int kPasses = ROWS / L::kRowsPerPass;
  static_assert(ROWS % L::kRowsPerPass == 0, "whole passes");
  const int row0 = tid / L::kPerRow, chunk0 = tid % L::kPerRow;
  if (vec && valid_rows >= ROWS && valid_cols >= COLS) {
    // The common case, kept lean: no bounds, and one global pointer bumped
    // pass by pass (an unrolled set of row * row_stride products would be
    // hoisted out of the key loop and pinned in registers).
    const T* g = src + static_cast<int64_t>(row0) * row_stride + chunk0 * Tile::kChunkElems;
    const int64_t pass_stride = static_cast<int64_t>(L::kRowsPerPass) * row_stride;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass, g += pass_stride)
#pragma unroll
      for (int c = 0; c < L::kChunksPerThread; ++c)
        cp_async_16(smem_addr(tile.ptr + Tile::chunk_offset(row0 + pass * L::kRowsPerPass, chunk0 + c * L::kPerRow)),
                    g + c * L::kPerRow * Tile::kChunkElems);
    return;
  }
  // Chunk c of pass `pass` through `copy(smem, gmem, elements to read)`.
  auto for_chunk = [&](int pass, int c, auto&& copy) {
    const int row = row0 + pass * L::kRowsPerPass;
    const int chunk = chunk0 + c * L::kPerRow;
    const int col = chunk * Tile::kChunkElems;
    int n = row < valid_rows ? valid_cols - col : 0;
    n = n < 0 ? 0 : (n > Tile::kChunkElems ? Tile::kChunkElems : n);
    copy(tile.ptr + Tile::chunk_offset(row, chunk), src + static_cast<int64_t>(row) * row_stride + col, n);
  };
  // Tails (and everything else) are not unrolled: they are rare, and unrolled
  // their address and bound arithmetic would cost the registers the main path
  // needs. The element-wise fallback's loads would all be in flight at once.
  if (vec) {
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass)
#pragma unroll
      for (int c = 0; c < L::kChunksPerThread; ++c)
        for_chunk(pass, c, [&](char* s, const T* g, int n) {
          cp_async_16_zfill(smem_addr(s), n > 0 ? g : src, n * static_cast<int>(sizeof(T)));
        });
  } else {
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass)
#pragma unroll 1
      for (int c = 0; c < L::kChunksPerThread; ++c)
        for_chunk(pass, c, [&](char* s, const T* g, int n) {
          *reinterpret_cast<uint4*>(s) = load_chunk_bits(g, n);
        });
  }
}

// Rows [row0, row_end) of a tile zeroed, every column: rows that a sequence
// length hides but that lie inside the tensor, so a TMA load read them (it
// zero-fills only rows past the tensor); a probability of 0 there would still
// carry 0 * (inf or NaN) from them into a product. The same trip count for
// every thread (ptxas serialises wgmma near divergent code).
template <class Tile>
__device__ __forceinline__ void zero_rows(const Tile& tile, int row0, int row_end, int tid, int threads) {
  constexpr int kChunks = Tile::kCols / Tile::kChunkElems;
  for (int i = row0 * kChunks; i < row_end * kChunks; i += threads) {
    const int c = i + tid;
    if (c < row_end * kChunks)
      *reinterpret_cast<uint4*>(tile.ptr + Tile::chunk_offset(c / kChunks, c % kChunks)) = make_uint4(0, 0, 0, 0);
  }
}

// Tile rows [row0, row0 + kRowsPerCopy) -> global `dst` (first of those rows),
// copied by the `kCopyThreads` threads whose index in the group is `idx`. Rows
// >= valid_rows and columns >= valid_cols are not written. `vec` as in
// load_tile; the vector path uses 16-byte stores.
template <int kCopyThreads, int kRowsPerCopy, class Tile>
__device__ __forceinline__ void store_tile_rows(const Tile& tile, int row0, typename Tile::Elem* dst,
                                                int64_t row_stride, int valid_rows, int valid_cols, bool vec,
                                                int idx) {
  using T = typename Tile::Elem;
  constexpr int kChunks = kRowsPerCopy * Tile::kChunksPerRow;
  static_assert(kChunks % kCopyThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < kChunks / kCopyThreads; ++i) {
    const int chunk_id = idx + i * kCopyThreads;
    const int row = chunk_id / Tile::kChunksPerRow;
    const int chunk = chunk_id % Tile::kChunksPerRow;
    const int col = chunk * Tile::kChunkElems;
    if (row >= valid_rows || col >= valid_cols) continue;
    const char* s = tile.ptr + Tile::chunk_offset(row0 + row, chunk);
    T* g = dst + static_cast<int64_t>(row) * row_stride + col;
    if (vec && col + Tile::kChunkElems <= valid_cols) {
      *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(s);
    } else {
      const int n = valid_cols - col < Tile::kChunkElems ? valid_cols - col : Tile::kChunkElems;
      for (int e = 0; e < n; ++e) reinterpret_cast<Bits<T>*>(g)[e] = reinterpret_cast<const Bits<T>*>(s)[e];
    }
  }
}

}  // namespace jaxflash::gpu
