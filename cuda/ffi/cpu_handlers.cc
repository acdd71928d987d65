// XLA FFI handlers of the CPU kernels: decode, then run the kernel on XLA's
// intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "cuda/cpu/kernels.h"
#include "cuda/ffi/decode.h"
#include "cuda/ffi/handlers.h"

namespace jaxflash {
namespace {

// Runs tasks [0, n) on the calling thread and the pool's workers. The caller
// drains the queue too, so this finishes even if no worker ever starts; workers
// that start late find it empty. An exception in a task fails the call.
class PoolParallelFor {
 public:
  explicit PoolParallelFor(ffi::ThreadPool pool) : pool_(pool) {}

  void operator()(int64_t n, const std::function<void(int64_t)>& task) {
    if (n <= 0) return;
    auto state = std::make_shared<State>();
    state->n = n;
    state->task = &task;
    const int64_t helpers = std::min<int64_t>(pool_.num_threads(), n) - 1;
    for (int64_t i = 0; i < helpers; ++i) pool_.Schedule([state] { drain(*state); });
    drain(*state);
    std::unique_lock<std::mutex> lock(state->mutex);
    state->finished.wait(lock, [&] { return state->done.load() == state->n; });
    if (state->failed) failed_ = true;
  }

  bool failed() const { return failed_; }

 private:
  struct State {
    int64_t n = 0;
    const std::function<void(int64_t)>* task = nullptr;
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<bool> failed{false};
    std::mutex mutex;
    std::condition_variable finished;
  };

  static void drain(State& s) {
    for (int64_t i = s.next++; i < s.n; i = s.next++) {
      try {
        (*s.task)(i);
      } catch (...) {
        s.failed = true;
      }
      if (++s.done == s.n) {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.finished.notify_all();
      }
    }
  }

  ffi::ThreadPool pool_;
  bool failed_ = false;
};

ffi::Error run_on_pool(ffi::ThreadPool pool, void (*kernel)(const AttentionParams&, const cpu::ParallelFor&),
                       const AttentionParams& p) {
  PoolParallelFor parallel_for(pool);
  kernel(p, std::ref(parallel_for));
  if (parallel_for.failed()) return ffi::Error::Internal("jaxflash: CPU kernel task failed (out of memory?)");
  return ffi::Error::Success();
}

ffi::Error forward_cpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                       ffi::AnyBuffer seed, ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                       ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer scale,
                       ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> /*workspace: the CPU kernels need none*/, LayoutAttrs attrs) {
  AttentionParams p;
  if (auto e = decode_forward(
          p, {q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, alibi_slopes, scale}, *o,
          *lse, attrs);
      e.failure())
    return e;
  return run_on_pool(pool, &cpu::forward, p);
}

ffi::Error backward_cpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer q_lens, ffi::AnyBuffer kv_lens,
                        ffi::AnyBuffer seed, ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                        ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer scale,
                        ffi::AnyBuffer lse, ffi::AnyBuffer delta, ffi::AnyBuffer d_o, ffi::AnyBuffer dscale_centre,
                        ffi::AnyBuffer dalibi_centre,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> dalibi, ffi::Result<ffi::AnyBuffer> dscale,
                        ffi::Result<ffi::AnyBuffer> /*workspace: the CPU kernels need none*/, LayoutAttrs attrs) {
  AttentionParams p;
  if (auto e = decode_backward(
          p, {q, k, v, bias, mask, q_lens, kv_lens, seed, q_segment_ids, kv_segment_ids, alibi_slopes, scale}, lse,
          delta, d_o, dscale_centre, dalibi_centre, *dq, *dk, *dv, *dbias, *dalibi, *dscale, attrs);
      e.failure())
    return e;
  return run_on_pool(pool, &cpu::backward, p);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_forward_cpu, forward_cpu,
                              bind_forward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxflash_backward_cpu, backward_cpu,
                              bind_backward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace jaxflash
