// Entry points of the CPU kernels. They take the decoded AttentionParams and a
// ParallelFor that runs task(i) for i in [0, n) on however many threads the
// caller has (the FFI handler passes XLA's intra-op thread pool). Each output
// element is written by exactly one task in a fixed order, so results are
// bitwise deterministic whatever the thread count.
#pragma once

#include <cstdint>
#include <functional>

#include "cuda/params.h"

namespace jaxflash::cpu {

using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& task)>;

// o, lse from q, k, v (+ bias, mask, lengths).
void forward(const AttentionParams& p, const ParallelFor& parallel_for);

// dq, dk, dv (+ dbias) from q, k, v, lse, delta, d_o (+ bias, mask, lengths).
void backward(const AttentionParams& p, const ParallelFor& parallel_for);

}  // namespace jaxflash::cpu
