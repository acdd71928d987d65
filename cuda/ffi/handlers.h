// The FFI handler symbols the Python module registers with XLA.
#pragma once

#include "xla/ffi/api/api.h"

namespace jaxflash {

XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxflash_forward_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxflash_backward_cpu);

#ifdef JAXFLASH_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxflash_forward_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxflash_backward_cuda);
#endif

}  // namespace jaxflash
