// The Python extension jaxflash._native: hands the FFI handlers to Python as
// capsules, per platform, for jax.ffi.register_ffi_target, and reports what
// this build is and the constants of its contract with jaxflash/contract.py.
#include <nanobind/nanobind.h>

#include "cuda/cpu/isa.h"
#include "cuda/ffi/decode.h"
#include "cuda/ffi/handlers.h"
#include "cuda/params.h"
#ifdef JAXFLASH_WITH_CUDA
#include "cuda/gpu/backward.h"
#include "cuda/gpu/forward.h"
#endif

namespace nb = nanobind;

namespace {

template <class Fn>
nb::capsule as_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The constants the Python side must agree with (jaxflash/contract.py holds its copy and
// tests/test_contract.py compares the two), named as Python names them.
nb::dict contract() {
  using namespace jaxflash;
  nb::dict flags;
  flags["HAS_BIAS"] = static_cast<int64_t>(kHasBias);
  flags["HAS_MASK"] = static_cast<int64_t>(kHasMask);
  flags["HAS_Q_LENS"] = static_cast<int64_t>(kHasQLens);
  flags["HAS_KV_LENS"] = static_cast<int64_t>(kHasKvLens);
  flags["BOTTOM_RIGHT"] = static_cast<int64_t>(kBottomRight);
  flags["HAS_DBIAS"] = static_cast<int64_t>(kHasDbias);
  flags["OUTPUT_F32"] = static_cast<int64_t>(kOutputF32);
  flags["EXACT_F32"] = static_cast<int64_t>(kExactF32);
  flags["DROPOUT"] = static_cast<int64_t>(kDropout);
  flags["HAS_SEGMENT_IDS"] = static_cast<int64_t>(kHasSegmentIds);
  flags["HAS_ALIBI"] = static_cast<int64_t>(kHasAlibi);
  flags["HAS_DALIBI"] = static_cast<int64_t>(kHasDalibi);
  flags["SCALE_OPERAND"] = static_cast<int64_t>(kScaleOperand);
  flags["HAS_DSCALE"] = static_cast<int64_t>(kHasDscale);
  flags["DROPOUT_OFFSETS"] = static_cast<int64_t>(kDropoutOffsets);
  nb::dict dtypes;
  dtypes["float32"] = static_cast<int32_t>(DType::kF32);
  dtypes["float16"] = static_cast<int32_t>(DType::kF16);
  dtypes["bfloat16"] = static_cast<int32_t>(DType::kBF16);
  nb::list slots;
  for (int slot = 0; slot < kSlots; ++slot) slots.append(slot_name(slot));
  nb::dict result;
  result["flags"] = flags;
  result["dtype_codes"] = dtypes;
  result["slots"] = nb::tuple(slots);
  result["max_instance_dims"] = kMaxInstanceDims;
  result["unbounded"] = kUnbounded;
  result["cuda_max_seqlen"] = kCudaMaxSeqLen;
  result["dropout_resolution"] = kDropoutResolution;
  return result;
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
  m.attr("cpu_instruction_sets") = jaxflash::cpu::instruction_sets();
  m.def("contract", &contract);
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
  // Scratch bytes each direction needs (its last result), sized at abstract
  // evaluation; 0 in a CPU-only build (the CPU kernels need none).
  m.def("forward_workspace_bytes", [](int64_t instances, int64_t seqlen_q, int64_t seqlen_k,
                                      int64_t head_dim, int dtype, bool has_segment_ids) -> int64_t {
#ifdef JAXFLASH_WITH_CUDA
    return jaxflash::gpu::forward_workspace_bytes(instances, seqlen_q, seqlen_k, head_dim,
                                                  static_cast<jaxflash::DType>(dtype), has_segment_ids);
#else
    (void)instances, (void)seqlen_q, (void)seqlen_k, (void)head_dim, (void)dtype, (void)has_segment_ids;
    return 0;
#endif
  });
  m.def("backward_workspace_bytes", [](int64_t instances, int64_t seqlen_q, int64_t seqlen_k,
                                       int64_t head_dim, int dtype, bool has_segment_ids) -> int64_t {
#ifdef JAXFLASH_WITH_CUDA
    return jaxflash::gpu::backward_workspace_bytes(instances, seqlen_q, seqlen_k, head_dim,
                                                   static_cast<jaxflash::DType>(dtype), has_segment_ids);
#else
    (void)instances, (void)seqlen_q, (void)seqlen_k, (void)head_dim, (void)dtype, (void)has_segment_ids;
    return 0;
#endif
  });
}
