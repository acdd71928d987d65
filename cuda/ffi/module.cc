// The Python extension jaxflash._native: hands the FFI handlers to Python as
// capsules, per platform, for jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include "cuda/ffi/handlers.h"

namespace nb = nanobind;

namespace {

template <class Fn>
nb::capsule as_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_native, m) {
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
}
