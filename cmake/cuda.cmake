# The CUDA backend: kernels and their FFI handlers, linked into _native, and (with
# JAXFLASH_BUILD_SELFTESTS) the native self-tests. Included from CMakeLists.txt once
# cmake/cuda_architectures.cmake has chosen JAXFLASH_CUDA_BUILD_ARCHITECTURES.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_ARCHITECTURES ${JAXFLASH_CUDA_BUILD_ARCHITECTURES})

# The kernel instances: every (direction, variant, head dim), one generated translation unit
# each (cuda/gpu/instance.cu.in). A variant is a storage type and, for float32, the MMA
# flavour: f32 runs tf32 products, f32x3 the float32-accurate 3xTF32 ones, and f32p (forward
# only) tf32 ones with P whole in P.V, for the differentiated forward (primitives/mma.h).
set(JAXFLASH_HEAD_DIMS 32 64 96 128 192 256)
set(variant_types bf16:__nv_bfloat16 f16:__half f32:float f32x3:float f32p:float)
set(instance_sources_forward "")
set(instance_sources_backward "")
foreach(DIRECTION IN ITEMS forward backward)
  if(DIRECTION STREQUAL "forward")
    set(prefix fwd)
    set(RUNTIME FwdRuntime)
  else()
    set(prefix bwd)
    set(RUNTIME BwdRuntime)
  endif()
  set(LAUNCH_HEADER ${prefix}_launch.h)
  foreach(variant_type IN LISTS variant_types)
    string(REPLACE ":" ";" variant_type "${variant_type}")
    list(GET variant_type 0 VARIANT)
    list(GET variant_type 1 type)
    if(VARIANT STREQUAL "f32p" AND NOT DIRECTION STREQUAL "forward")
      continue()
    endif()
    foreach(HEAD_DIM IN LISTS JAXFLASH_HEAD_DIMS)
      set(INSTANCE_ARGS "${type}, ${HEAD_DIM}")
      if(VARIANT STREQUAL "f32x3")
        string(APPEND INSTANCE_ARGS ", F32Mma::k3xTf32")
      elseif(VARIANT STREQUAL "f32p")
        string(APPEND INSTANCE_ARGS ", F32Mma::kTf32WholeP")
      endif()
      set(source ${CMAKE_CURRENT_BINARY_DIR}/instances/${prefix}_${VARIANT}_d${HEAD_DIM}.cu)
      configure_file(${CMAKE_CURRENT_SOURCE_DIR}/cuda/gpu/instance.cu.in ${source} @ONLY)
      list(APPEND instance_sources_${DIRECTION} ${source})
    endforeach()
  endforeach()
endforeach()

# Release builds carry no line tables; RelWithDebInfo adds -lineinfo for Nsight Compute.
set(cuda_options -O3 --use_fast_math $<$<CONFIG:RelWithDebInfo>:-lineinfo>)

# The kernels of one direction, as objects: linked into _native and into that direction's
# self-test. `defines` adds compile definitions (the self-test of the mma.sync backward).
function(jaxflash_cuda_kernels name direction)
  add_library(${name} OBJECT cuda/gpu/${direction}.cu ${instance_sources_${direction}})
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_compile_options(${name} PRIVATE ${cuda_options})
  target_compile_definitions(${name} PRIVATE ${ARGN})
  set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
endfunction()
jaxflash_cuda_kernels(jaxflash_cuda_forward forward)
jaxflash_cuda_kernels(jaxflash_cuda_backward backward)

add_library(jaxflash_cuda STATIC cuda/ffi/cuda_handlers.cu
            $<TARGET_OBJECTS:jaxflash_cuda_forward> $<TARGET_OBJECTS:jaxflash_cuda_backward>)
target_include_directories(jaxflash_cuda PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_include_directories(jaxflash_cuda SYSTEM PRIVATE ${XLA_FFI_INCLUDE_DIR})
set_target_properties(jaxflash_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON CUDA_SEPARABLE_COMPILATION OFF)
target_compile_options(jaxflash_cuda PRIVATE ${cuda_options})
target_link_libraries(jaxflash_cuda PUBLIC CUDA::cudart_static)

string(REPLACE ";" "," architectures_text "${JAXFLASH_CUDA_BUILD_ARCHITECTURES}")
target_compile_definitions(jaxflash_cuda PRIVATE JAXFLASH_CUDA_ARCHITECTURES="${architectures_text}")
target_compile_definitions(_native PRIVATE JAXFLASH_WITH_CUDA JAXFLASH_CUDA_ARCHITECTURES="${architectures_text}")
target_link_libraries(_native PRIVATE jaxflash_cuda)

# The native self-tests: each direction's kernels against float64 CPU references, without
# JAX (scripts/gpu_check.sh runs them). fwd_mma_selftest and bwd_mma_selftest build each
# direction without its sm_90 kernel, so the mma.sync kernels that pre-Hopper GPUs run are
# verified on Hopper too.
if(JAXFLASH_BUILD_SELFTESTS)
  jaxflash_cuda_kernels(jaxflash_cuda_forward_mma forward JAXFLASH_FWD_NO_SM90)
  jaxflash_cuda_kernels(jaxflash_cuda_backward_mma backward JAXFLASH_BWD_NO_SM90)
  foreach(selftest fwd:forward fwd_mma:forward_mma bwd:backward bwd_mma:backward_mma)
    string(REPLACE ":" ";" selftest "${selftest}")
    list(GET selftest 0 name)
    list(GET selftest 1 kernels)
    string(REGEX REPLACE "_mma$" "" source ${name})
    add_executable(${name}_selftest cuda/gpu/tests/${source}_selftest.cu $<TARGET_OBJECTS:jaxflash_cuda_${kernels}>)
    target_include_directories(${name}_selftest PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
    target_compile_options(${name}_selftest PRIVATE ${cuda_options})
    set_target_properties(${name}_selftest PROPERTIES CUDA_RUNTIME_LIBRARY Static)
  endforeach()
endif()
