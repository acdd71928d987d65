// The one table of forward tile sizes: query rows (BLOCK_M) and keys (BLOCK_N)
// per CTA, by element size, padded head dim, and kernel variant (see
// kernel_traits.h: the general one also reads a bias / mask and copes with
// unaligned rows). Same on sm_80 and sm_90: the kernel is mma.sync throughout, and
// every entry keeps shared memory (BLOCK_M + 2 BLOCK_N) x D x sizeof(T) <= 96 KB,
// so it also launches on sm_86 / sm_89 (99 KB per block).
//
// Why these: 4 warps split BLOCK_M, so BLOCK_M = 128 gives each warp two m16
// fragments that share every K/V fragment it loads (half the shared-memory
// traffic per MMA of BLOCK_M = 64, which measured ~20% slower on H100).
// Registers bound the rest: a lane holds BLOCK_M/64 x (BLOCK_N + D)/2 fp32
// accumulators (scores + O) beside its fragments and addresses, within 255.
// Hence 128 x 64 up to D = 128 (128 x 128 for D = 32, whose O is small; at
// D = 64 it spilled and was no faster) and BLOCK_M = 64 for D = 192 / 256.
// fp32 tiles are 4 bytes an element, so they shrink to fit the same shared
// memory. The general variant reads bias and mask from global memory straight
// into the score registers, and those loads need registers of their own, as
// does its element-wise fallback copy: it halves BLOCK_M where it is 128.
//
//                 D:   32   64   96  128  192  256
//   f16/bf16      M:  128  128  128  128   64   64
//                 N:  128   64   64   64   64   64
//   f32           M:  128  128   64   64   64   64
//                 N:   64   64   64   64   32   16
//   general       M:   64 everywhere, N as above
#pragma once

namespace jaxflash::gpu {

template <int kElemBytes, int D, bool kGeneral>
struct FwdTileSize {
  static constexpr bool k16 = kElemBytes == 2;
  static constexpr int kBlockM = !kGeneral && (D <= 64 || (k16 && D <= 128)) ? 128 : 64;
  static constexpr int kBlockN = k16 ? (D <= 32 ? 128 : 64) : (D <= 128 ? 64 : (D <= 192 ? 32 : 16));
  // Schedule, measured on H100 for the fast 16-bit kernels at D = 64 and 128
  // (the paths that matter most for speed): giving whole tiles their own copy
  // of the tile step (no mask branches) is worth a few % there. Elsewhere
  // (unmeasured, or spilling kilobytes: large D, fp32) one compact step.
  static constexpr bool kSplitSteps = k16 && !kGeneral && (D == 64 || D == 128);
};

}  // namespace jaxflash::gpu

namespace jaxflash::gpu {

// The sm_90 forward (fwd_sm90_kernel.h): 16-bit types at D = 64, 128 and 256
// with the fast variant's conditions (fwd_launch.h); other head dims run the
// mma.sync kernel above (96 and 192 are not whole 64-column swizzle atoms). A CTA is a producer warpgroup and BLOCK_M / 64
// consumer warpgroups of 64 query rows each (a wgmma's M).
// BLOCK_N = 128 keys per tile: S is a 64 x 128 accumulator (64 registers per
// thread) beside O (D / 2) and P as the next product's A operand (32).
//   D = 128: BLOCK_M = 128, two consumers of 240 registers. Two stages of K
//            and V: (128 + 4 x 128) x 128 x 2 bytes = 160 KB, one CTA per SM
//            (+ 32 KB for O: persistent, below).
//            Wide keys (kWideKeys, the plain and dropout copies): BLOCK_N =
//            160, S 80 registers and P 40, (128 + 128 + 4 x 160) x 256 bytes =
//            224 KB with O. Each round of key tiles has a cost that does not
//            grow with BLOCK_N (O's rescale, the rows' max and sum across
//            lanes, the ping-pong hand-over), so fewer, wider rounds win where
//            the last tile's padding is small. Measured against BLOCK_N = 128
//            (H100, bf16, self-test bench, 2 alternating rounds, 2026-11-26):
//            N = 16k 1.055 / 1.058 (causal), 4k 1.026 / 1.022, 1k 0.968 /
//            0.948. A round costs about BLOCK_N + 52 keys' work (fitted to the
//            16k cell; it predicts 0.97 at 1k): fwd_sm90_wide_keys picks the
//            width that costs less by that count.
//   D = 64:  BLOCK_M = 192, three consumers of 160 registers (FlashAttention-3's
//            shape): at D = 64 the products are short beside the softmax, and a
//            third warpgroup keeps the tensor cores fed. Measured against
//            BLOCK_M = 128 (H200, self-test bench, 2 alternating rounds): 1.09 /
//            1.19 / 1.21 at N = 1k / 4k / 16k, causal 1.02 / 1.14 / 1.20, although
//            ptxas spills ~160 bytes at 160 registers.
//   D = 256: BLOCK_M = 128, two consumers, BLOCK_N = 64: O is 128 registers per
//            thread, so S shrinks to 32 (and P to 16); two stages of K and V at
//            64 keys: (128 + 4 x 64) x 256 x 2 bytes = 192 KB. FlashAttention-3
//            takes 80 keys there; wgmma_ss has N = 64 / 128 only.
// A consumer warp's rows of O: its epilogue's share, and the box of its TMA stores
// (forward.cu encodes o's descriptor with it).
constexpr int kFwdSm90WarpRows = 16;

// The sm_90 forward's copies by score modifier (FwdSm90Config::kMods; fwd_launch.h picks by
// kernel_traits.h's fwd_sm90_mods): none (the plain and dropout copies), a copy for each
// modifier alone, which applies it unconditionally, and the general copy, which tests each
// modifier at run time and takes any mix of them and a traced or non-positive scale. One copy
// for all (as first written) carried every modifier's code in its round loop: 2565 SASS
// instructions against the plain copy's 928, and with only a traced scale it ran at 0.78-0.86
// of the plain copy (H200, bf16, session 16).
enum class FwdMods { kNone, kSoftCap, kAlibi, kSegmentIds, kGeneral };

constexpr bool fwd_sm90_covers(int elem_bytes, int head_dim) {
  return elem_bytes == 2 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
}

// The copies that have a 160-key shape (kWideKeys): at D = 128 the plain and dropout copies and
// ALiBi's. ALiBi's against its 128-key shape (H200, bf16, jaxflash.bench's measure, ratio to
// the plain copy in one process, best of 2 rounds at 4k, 2026-11-29): N = 4k 0.934 / 0.889,
// causal 0.910 / 0.863, 16k 0.858 / 0.803, 1k (which keeps 128) 0.925 / 0.909; the soft-cap's
// measured no gain (4k 0.796 / 0.805, causal 0.775 / 0.796, 16k 0.751 / 0.749: its SFU work,
// not the rounds, sets its pace) and keeps 128 keys.
constexpr bool fwd_sm90_has_wide_keys(int head_dim, FwdMods mods) {
  return head_dim == 128 && (mods == FwdMods::kNone || mods == FwdMods::kAlibi);
}
// Whether a copy that has them takes 160-key tiles (D = 128, above): where
// the rounds it needs, at BLOCK_N + 52 keys' work each, cost less than 128-key
// ones (N = 1k: 7 x 212 > 8 x 180, no; 2k and longer, yes).
constexpr bool fwd_sm90_wide_keys(int head_dim, long long seqlen_k) {
  auto rounds_cost = [&](long long block_n) { return (seqlen_k + block_n - 1) / block_n * (block_n + 52); };
  return head_dim == 128 && rounds_cost(160) < rounds_cost(128);
}

//
// Ping-pong (two consumers take turns to issue their products), measured on
// the H100 against no turns (self-test bench, 2 alternating rounds): at D = 128
// they gain 1-4% at N <= 4k and cost ~5% non-causal at 16k: kept. At D = 64,
// still with two consumers then, they cost 2-4% at N >= 4k; with three there
// are no turns.
//
// Persistent (fwd_sm90_kernel.h): one CTA per SM takes query tiles from an
// atomic counter, so the next tile's Q and K / V load while the current one
// finishes. O stages through a buffer of its own (kSeparateO), so that Q is free
// once the tile's last S product is done: D = 128 160 + 32 KB, D = 64 88 + 24 KB
// (the copies of two consumers 80 + 16). At D = 256 Q, K and V take 192 KB and another
// 64 KB would pass the 227 KB a CTA may have: O reuses Q's buffer there, and the
// next Q loads only after the epilogue (the next tile's first K before it).
// Measured against a CTA per tile (H100, bf16): N = 1k 1.16-1.26x at D = 64 /
// 128, 1.06-1.08x at D = 256; 4k 1.01-1.05x; 16k 0.95-1.01x. Tried before and not kept: a persistent grid with a static order
// of the tiles (branch sm90-persistent-2): 0.82-1.05 of the non-persistent grid
// on the H100, behind under causal masking (docs/DESIGN.md's known gaps).
//
// The score modifiers' copies (FwdMods) at D = 64: the soft-cap's and ALiBi's take the plain
// copy's three consumers (ptxas bf16 spill stores / loads, whole kernel: 92 / 172 and 172 / 256
// against the plain copy's 52 / 60; ALiBi's forward went 0.59 -> 0.80 of the plain copy's at
// N = 4k); the segment ids' and the general copy take D = 128's shape, two consumers of 240
// registers, since at 160 they spilled 1432 / 1588 and 724 / 792 (at 240 none in their round
// loops).
//
// D = 64's main loop (fwd_sm90_mainloop.h), both measured together (H200, bf16, kernel
// alone against main, 2 alternating rounds, 2026-11-28): 1.11x at N = 1k causal, 1.03x at 4k
// causal, 1.01-1.02x elsewhere.
//   kSkipUnseen: a consumer passes the key tiles its own 64 rows cannot see (under causal
//     masking a 192-row tile's top tiles right of the first warpgroups' diagonals; a window's
//     far edge) instead of computing them masked: ~10% of the products at N = 1k causal.
//   kSplitMaskLoops: the masked and the mask-free rounds as two loops, so that the steady
//     state compiles without the mask's registers. ptxas bf16 spill stores / loads, whole
//     kernel: 184 / 184 -> 52 / 60 (the softmax state had been spilled every round; what is
//     left is the producer's), the dropout copy 196 / 212 -> 68 / 112.
// Not at D = 128 / 256, where the same code measured 0.98-0.99x (256: 0.97-0.99x): their
// 64-row warpgroups over 128-key (64 at D = 256) tiles leave little unseen, and at D = 256
// the split loops spilled more (52 / 60 -> 88 / 128), at D = 128 with wide keys and dropout
// too (92 / 100 -> 136 / 280). In the copies of three consumers (above), and in the segment ids'
// copy at D = 128, whose per-element id test (64 loads and compares a round, branched over) then
// stays in the masked loop with the tiles that need it (fwd_sm90_mainloop.h): its mask-free loop
// is 801 SASS instructions against 2195 in one loop (bf16; no spills in either). Sixteen packed
// 1k documents against separate rows (H200, 2026-11-29): forward 0.742 -> 0.771; at D = 64,
// whose ids copy takes D = 128's shape, 0.674 -> 0.660, so not there.
// The soft-cap's copy takes every 4th n-fragment's exp2 on the FMA pipe (kExp2PolyEvery,
// softmax.h's poly_exp2): each of its scores has a tanh and an exp2 on the SFU, which at D = 128
// is as long as the score's two products on the tensor cores, so a warpgroup's softmax outlasts
// the other's products. Against all on the SFU (H200, bf16, ratio to the plain copy in one
// process, 2026-11-29): D = 128 N = 4k 0.800 -> 0.835, causal 0.812 -> 0.830, 16k 0.771 ->
// 0.812, 1k 0.864 -> 0.865; D = 64 (4k, causal, 16k, 1k) 0.69 / 0.72 / 0.67 / 0.77 -> 0.70 /
// 0.71 / 0.69 / 0.78 (ptxas bf16 spills 76 / 84 -> 92 / 172). On the plain copy at D = 64 the
// same share lost (0.925-0.954, BENCHMARKS.md, branch fwd-exp2-poly): one exp2 per score leaves
// the SFU the idler pipe there.
template <int D, FwdMods kMods = FwdMods::kNone, bool kWideKeys = false>
struct FwdSm90TileSize {
  static_assert(!kWideKeys || fwd_sm90_has_wide_keys(D, kMods), "see fwd_sm90_has_wide_keys");
  static constexpr bool kThreeConsumers = D == 64 && (kMods == FwdMods::kNone || kMods == FwdMods::kSoftCap || kMods == FwdMods::kAlibi);
  static constexpr int kBlockM = kThreeConsumers ? 192 : 128;
  static constexpr int kBlockN = D == 256 ? 64 : kWideKeys ? 160 : 128;
  static constexpr int kStages = 2;
  static constexpr bool kPingPong = !kThreeConsumers;  // two consumers take turns
  static constexpr bool kSeparateO = D != 256;  // O's own staging buffer (above)
  static constexpr int kTileSlots = 2;  // tiles the producer may hand over ahead of the consumers
  static constexpr bool kSkipUnseen = kThreeConsumers;      // (above: D = 64)
  static constexpr bool kSplitMaskLoops = kThreeConsumers || (D == 128 && kMods == FwdMods::kSegmentIds);
  static constexpr int kExp2PolyEvery = kMods == FwdMods::kSoftCap ? 4 : 0;  // (above)
  // Whether a round's softmax runs beside its own warpgroup's P V (fwd_sm90_mainloop.h: the
  // wait for P V kept below the exp2s by wgmma_wait_in_order, primitives/wgmma.h; before,
  // ptxas put it above them in every copy). Against the wait above them (H200, bf16, kernel
  // alone, fwd_selftest bench, 3 alternating rounds, 2026-11-29): D = 128 1.01-1.03 (16k
  // 0.99-1.00), D = 256 1.01-1.07. The copies of three consumers (D = 64, 160 registers, no
  // turns) lost 2-5% with it (2 rounds), and their dropout copy spilled 504 / 564 B against
  // 28 / 52: not there.
  static constexpr bool kSoftmaxBesidePv = !kThreeConsumers;
};

// A tile slot's bytes (fwd_sm90_mainloop.h's FwdTileSlot): the tile's index, and in the copies
// with segment ids the producer's started walk.
constexpr int fwd_sm90_slot_bytes(FwdMods mods) {
  return mods == FwdMods::kSegmentIds || mods == FwdMods::kGeneral ? 24 : 4;
}

// Its shared memory: Q, O where kSeparateO, kStages K and V tiles, the mbarriers
// (Q's two, the tile slots' two each, four per stage), the tile slots, and 1 KB
// to align the base to the swizzle's 1024-byte atom (fwd_sm90_mainloop.h).
template <int D, FwdMods kMods = FwdMods::kNone, bool kWideKeys = false>
constexpr int fwd_sm90_smem_bytes() {
  using Tiles = FwdSm90TileSize<D, kMods, kWideKeys>;
  return (Tiles::kBlockM * (Tiles::kSeparateO ? 2 : 1) + 2 * Tiles::kStages * Tiles::kBlockN) * D * 2 +
         (2 + 2 * Tiles::kTileSlots + 4 * Tiles::kStages) * 8 + Tiles::kTileSlots * fwd_sm90_slot_bytes(kMods) + 1024;
}

}  // namespace jaxflash::gpu
