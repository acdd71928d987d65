// The Python extension jaxflash._native: hands the FFI handlers to Python as
// capsules, per platform, for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "cuda/ffi/handlers.h"
#ifdef JAXFLASH_WITH_CUDA
#include "cuda/gpu/backward.h"
#endif

namespace nb = nanobind;

namespace {

template <class Fn>
nb::capsule as_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_native, m) {
  // What this build is, for jaxflash.native's check that the Python sources
  // match the extension and for `python -m jaxflash`'s report.
  m.attr("version") = JAXFLASH_VERSION;
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAXFLASH_WITH_CUDA
  m.attr("cuda_architectures") = JAXFLASH_CUDA_ARCHITECTURES;
#else
  m.attr("cuda_architectures") = "";
#endif
  m.def("cpu_targets", []() {
    nb::dict targets;
    targets["jaxflash_fwd"] = as_capsule(jaxflash::jaxflash_forward_cpu);
    targets["jaxflash_bwd"] = as_capsule(jaxflash::jaxflash_backward_cpu);
    return targets;
  });
  m.def("cuda_targets", []() {
    nb::dict targets;
#ifdef JAXFLASH_WITH_CUDA
    targets["jaxflash_fwd"] = as_capsule(jaxflash::jaxflash_forward_cuda);
    targets["jaxflash_bwd"] = as_capsule(jaxflash::jaxflash_backward_cuda);
#endif
    return targets;
  });
  // Scratch bytes the backward needs (its last result), sized at abstract
  // evaluation; 0 in a CPU-only build (the CPU kernels need none).
  m.def("backward_workspace_bytes", [](int64_t instances, int64_t seqlen_q, int64_t seqlen_k,
                                       int64_t head_dim, int dtype) -> int64_t {
#ifdef JAXFLASH_WITH_CUDA
    return jaxflash::gpu::backward_workspace_bytes(instances, seqlen_q, seqlen_k, head_dim,
                                                   static_cast<jaxflash::DType>(dtype));
#else
    (void)instances, (void)seqlen_q, (void)seqlen_k, (void)head_dim, (void)dtype;
    return 0;
#endif
  });
}
