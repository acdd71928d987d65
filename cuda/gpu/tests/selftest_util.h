// What the forward and backward self-tests share: CUDA error checks, host
// arrays of dtype values, device buffers, strided views and the exact-float32
// variant of a case. Included by exactly one translation unit each.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../params.h"

#define CHECK_CUDA(x)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

namespace {

using jaxflash::ArrayView;
using jaxflash::AttentionParams;
using jaxflash::DType;

constexpr int64_t kUnb = jaxflash::kUnbounded;

// A float32 case run with kExactF32 (3xTF32 MMAs, held to fp32 accuracy);
// each self-test wraps it as exact(Case) for braced case lists.
template <class Case>
Case exact_variant(Case c) {
  c.exact = true;
  c.name = "exact " + c.name;
  return c;
}

int elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// Host storage of dtype-t values as raw bits (what the kernel reads or wrote),
// plus, for values stored with set(), the rounded values in double.
struct HostArray {
  DType t;
  std::vector<uint8_t> bits;
  std::vector<double> val;
  HostArray(DType t_, size_t n, uint8_t fill = 0) : t(t_), bits(n * elem_bytes(t_), fill), val(n) {}
  size_t size() const { return val.size(); }
  // Stores x rounded to t; returns the rounded value.
  double set(size_t i, double xd) {
    const float x = static_cast<float>(xd);
    if (t == DType::kF32) {
      std::memcpy(&bits[4 * i], &x, 4);
      val[i] = x;
    } else if (t == DType::kF16) {
      const __half h = __float2half_rn(x);
      std::memcpy(&bits[2 * i], &h, 2);
      val[i] = __half2float(h);
    } else {
      const __nv_bfloat16 h = __float2bfloat16_rn(x);
      std::memcpy(&bits[2 * i], &h, 2);
      val[i] = __bfloat162float(h);
    }
    return val[i];
  }
  // Element i of the bits (also after a download into them).
  double get(size_t i) const {
    float x;
    if (t == DType::kF32) {
      std::memcpy(&x, &bits[4 * i], 4);
    } else if (t == DType::kF16) {
      __half h;
      std::memcpy(&h, &bits[2 * i], 2);
      x = __half2float(h);
    } else {
      __nv_bfloat16 h;
      std::memcpy(&h, &bits[2 * i], 2);
      x = __bfloat162float(h);
    }
    return x;
  }
};

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { CHECK_CUDA(cudaMalloc(&ptr, n ? n : 1)); }
  DeviceBuffer(const void* host, size_t n) : DeviceBuffer(n) {
    CHECK_CUDA(cudaMemcpy(ptr, host, n, cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void download(void* host) const { CHECK_CUDA(cudaMemcpy(host, ptr, bytes, cudaMemcpyDeviceToHost)); }
};

// Instance strides (batch, kv head, group), row and column strides.
void set_view(ArrayView& v, void* data, int64_t sb, int64_t skh, int64_t sg, int64_t row, int64_t col) {
  v.data = data;
  v.inst_stride[0] = sb, v.inst_stride[1] = skh, v.inst_stride[2] = sg;
  v.row_stride = row, v.col_stride = col;
}

// Segment ids (params.h's packed sequences) of a case, and what they exercise.
enum class Segments {
  kNone,
  kDocs,      // documents of 1..97 positions numbered in order (tiles skipped, element tests at
              // document edges); batch 1 ends in padding: -1 on the query side, -2 on the key side
  kTileDocs,  // documents of 64 or 128 positions: their edges on tile boundaries
  kRandom,    // ids in {0, 1, 2} in any order: no tile skipped, the element test everywhere
};

// Segment ids, a soft-cap, ALiBi: the case with that feature (each self-test
// wraps these for braced case lists, as exact above).
template <class Case>
Case segments_variant(Case c, Segments s) {
  c.segments = s;
  return c;
}
template <class Case>
Case softcap_variant(Case c, float cap) {
  c.softcap = cap;
  return c;
}
template <class Case>
Case alibi_variant(Case c) {
  c.alibi = true;
  return c;
}

// (B, L) int32 ids, row-major, for sequences of length L. Queries and keys get the same
// documents (the same `seed`) over their own lengths, as in self-attention; `pad_id` marks
// the padding of kDocs.
std::vector<int32_t> segment_ids(Segments kind, int B, int L, int32_t pad_id, uint32_t seed) {
  std::vector<int32_t> ids(size_t(B) * L, 0);
  std::mt19937 rng(seed);
  for (int b = 0; b < B; ++b) {
    int32_t* row = ids.data() + size_t(b) * L;
    if (kind == Segments::kRandom) {
      for (int i = 0; i < L; ++i) row[i] = std::uniform_int_distribution<int>(0, 2)(rng);
      continue;
    }
    // Document lengths drawn up to a fixed extent (past any case's L), so that both sides
    // draw the same documents.
    constexpr int kExtent = 4096;
    int32_t doc = 0;
    for (int start = 0; start < kExtent;) {
      const int len = kind == Segments::kTileDocs ? 64 * std::uniform_int_distribution<int>(1, 2)(rng)
                                                  : std::uniform_int_distribution<int>(1, 97)(rng);
      for (int i = start; i < start + len && i < L; ++i) row[i] = doc;
      start += len, ++doc;
    }
    if (kind == Segments::kDocs && b == 1)
      for (int i = std::max(0, L - 5); i < L; ++i) row[i] = pad_id;
  }
  return ids;
}

// The bench's shapes to time: `bench-only [D N causal|full [packed]]` picks one; 0 / -1 mean every
// value. packed: the shape's rows of N packed one after another into one row of 16384 with segment
// ids (a document per row: the same work, through the segment-id copies), where a self-test has it.
struct BenchFilter {
  int head_dim = 0, seqlen = 0, causal = -1;
  bool packed = false;

  bool skips(int head_dim_, int seqlen_, bool causal_) const {
    return (head_dim && head_dim_ != head_dim) || (seqlen && seqlen_ != seqlen) || (causal >= 0 && int(causal_) != causal);
  }
};

// The packed bench's ids (BenchFilter::packed): token t of the row of T in document t / doc_len,
// on both sides, written to `ids` (4 T bytes) and set as p's segment ids.
inline void set_packed_ids(AttentionParams& p, DeviceBuffer& ids, int T, int doc_len) {
  std::vector<int32_t> host_ids(T);
  for (int t = 0; t < T; ++t) host_ids[t] = t / doc_len;
  CHECK_CUDA(cudaMemcpy(ids.ptr, host_ids.data(), 4 * size_t(T), cudaMemcpyHostToDevice));
  p.flags |= jaxflash::kHasSegmentIds;
  set_view(p.q_segment_ids, ids.ptr, T, 0, 0, 1, 0);
  set_view(p.kv_segment_ids, ids.ptr, T, 0, 0, 1, 0);
}

// argv of `SELFTEST bench-only [D N causal|full [packed]]`: whether it is that mode, and the filter.
inline bool bench_only(int argc, char** argv, BenchFilter* only) {
  if (argc < 2 || std::string(argv[1]) != "bench-only") return false;
  if (argc > 4)
    *only = {std::atoi(argv[2]), std::atoi(argv[3]), std::string(argv[4]) == "causal" ? 1 : 0,
             argc > 5 && std::string(argv[5]) == "packed"};
  return true;
}

}  // namespace
