// Attention dropout's keep decision, shared by the CPU and CUDA kernels and
// restated in jaxflash/dropout.py (which the tests check against the kernels).
//
// A counter-based hash rather than a stateful generator, so that any kernel can
// decide any (query t, key s) entry on its own and the backward regenerates the
// forward's mask without storing it: the forward walks rows of P, the sm_90
// backward walks its transpose, and both must agree bit for bit.
//
//   row_key(t)   = mix(mix(t + seed0) ^ seed1)            once per query row
//   pair(s)      = 8 (s / 16) + s % 8                     keys s and s + 8 (s % 16 < 8) pair up
//   bits(t, s)   = mix(row_key(t) ^ pair(s) * 0x9E3779B9) once per pair
//   keep(t, s)   = (s % 16 < 8 ? bits % 2^16 : bits / 2^16) < keep_threshold
//
// One hash decides two entries, each from 16 of its bits: the hash is most of
// dropout's cost in the kernels (the integer pipe, beside the tensor cores), and
// keys s and s + 8 of a row are the pair that one thread holds in every kernel's
// accumulator layout (an mma / wgmma C fragment's n8 columns, and its rows in the
// sm_90 backward's transposed one). The rate resolves to 2^-16: keep_threshold
// = round(2^16 (1 - rate)) in [1, 2^16].
//
// mix is a 32-bit finalizer (xorshift-multiply, two rounds; its constants come
// from Wellons' hash search and avalanche well). Both steps are bijections of
// their counter for a fixed key, so pairs of one row never share a value.
// (seed0, seed1) are two words of jax.random.bits of the user's key, per
// instance (or one pair for all, broadcast_dropout).
//
// t and s are positions in the whole problem. A call on a block of it (ring
// attention: a device's queries against a visiting block of keys) gets the
// block's place with its seed (kDropoutOffsets: the seed operand's words 2 and 3,
// row_offset and col_offset) and hashes t + row_offset and s + col_offset, so
// that it drops exactly the entries the unsharded call drops. Positions enter
// the hash mod 2^32, so 32-bit offsets are exact. col_offset is a multiple of 16
// (jaxflash/ring.py keeps it so): then key s of the block pairs with s + 8 as key
// s + col_offset does, and each kernel's lane still holds both keys of a pair.
#pragma once

#include <cstdint>

#include "params.h"

namespace jaxflash {

// mix's first step, x ^ (x >> 16), is linear over xor: first(a ^ b) = first(a) ^ first(b),
// so a kernel applies it to a row's key and a pair's term apart (each once for many hashes).
JF_HOST_DEVICE uint32_t dropout_mix_first(uint32_t x) { return x ^ (x >> 16); }
JF_HOST_DEVICE uint32_t dropout_mix_rest(uint32_t x) {
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
JF_HOST_DEVICE uint32_t dropout_mix(uint32_t x) { return dropout_mix_rest(dropout_mix_first(x)); }

JF_HOST_DEVICE uint32_t dropout_row_key(uint32_t seed0, uint32_t seed1, int64_t t) {
  return dropout_mix(dropout_mix(static_cast<uint32_t>(t) + seed0) ^ seed1);
}

// The pair of key s (above), and its hash for a row.
JF_HOST_DEVICE uint32_t dropout_pair(int64_t s) {
  const uint32_t u = static_cast<uint32_t>(s);
  return (u >> 4 << 3) | (u & 7u);
}

// A pair's term in its hash (its multiple of the golden ratio): pair_term(a + b) =
// pair_term(a) + pair_term(b), so a kernel forms a block's terms from one product.
JF_HOST_DEVICE uint32_t dropout_pair_term(uint32_t pair) { return pair * 0x9E3779B9u; }
JF_HOST_DEVICE uint32_t dropout_pair_bits(uint32_t row_key, uint32_t pair) {
  return dropout_mix(row_key ^ dropout_pair_term(pair));
}

// The decisions a pair's hash makes: for its lower key (s % 16 < 8) and its upper one.
JF_HOST_DEVICE bool dropout_keep_lower(uint32_t bits, uint32_t threshold) { return (bits & 0xFFFFu) < threshold; }
JF_HOST_DEVICE bool dropout_keep_upper(uint32_t bits, uint32_t threshold) { return (bits >> 16) < threshold; }

// One instance's dropout: its seed words, the rate's threshold, and the place of
// the call's block in the whole problem (0, 0 for a whole problem).
// (All zero, threshold 0, when dropout is off: never consulted then.)
struct DropoutKey {
  uint32_t seed0 = 0, seed1 = 0, threshold = 0;
  uint32_t row_offset = 0, col_offset = 0;

  JF_HOST_DEVICE uint32_t row_key(int64_t t) const {
    return dropout_row_key(seed0, seed1, static_cast<uint32_t>(t) + row_offset);
  }
  // The pair of the block's key s.
  JF_HOST_DEVICE uint32_t pair(int64_t s) const { return dropout_pair(static_cast<uint32_t>(s) + col_offset); }
  // Entry (t, s) alone (a kernel holding both keys of a pair hashes it once). s decides
  // lower or upper as s + col_offset does: col_offset is a multiple of 16.
  JF_HOST_DEVICE bool keep(uint32_t row_key, int64_t s) const {
    const uint32_t bits = dropout_pair_bits(row_key, pair(s));
    return s & 8 ? dropout_keep_upper(bits, threshold) : dropout_keep_lower(bits, threshold);
  }
};

// words: the instance's seed words, p.seed.col_stride apart: the 2 seed words, then with
// kDropoutOffsets the block's row and column offsets.
JF_HOST_DEVICE DropoutKey make_dropout_key(const AttentionParams& p, const uint32_t* words) {
  const int64_t w = p.seed.col_stride;
  const bool placed = p.has(kDropoutOffsets);
  return {words[0], words[w], p.keep_threshold, placed ? words[2 * w] : 0u, placed ? words[3 * w] : 0u};
}

// The dropout of instance `linear`, or the unused all-zero key without kDropout
// (host code and the CPU kernels; the CUDA kernels use their InstanceIndex).
inline DropoutKey dropout_key(const AttentionParams& p, int64_t linear) {
  if (!p.has(kDropout)) return {};
  return make_dropout_key(p, static_cast<const uint32_t*>(p.seed.data) + instance_offset(p, p.seed, linear));
}

}  // namespace jaxflash
