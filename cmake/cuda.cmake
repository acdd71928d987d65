# The CUDA backend: kernels and their FFI handlers, linked into _native.
# Included from CMakeLists.txt once a CUDA compiler has been found.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_ARCHITECTURES ${JAXFLASH_CUDA_ARCHITECTURES})

# One translation unit per (dtype, head dim, direction) so builds parallelise.
file(GLOB JAXFLASH_CUDA_SOURCES CONFIGURE_DEPENDS
     ${CMAKE_CURRENT_SOURCE_DIR}/cuda/gpu/*.cu
     ${CMAKE_CURRENT_SOURCE_DIR}/cuda/gpu/instantiations/*.cu)
if(NOT JAXFLASH_CUDA_SOURCES OR NOT EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/cuda/ffi/cuda_handlers.cu)
  message(STATUS "jaxflash: CUDA kernels or handlers not present; CPU backend only")
  return()
endif()

add_library(jaxflash_cuda STATIC ${JAXFLASH_CUDA_SOURCES} cuda/ffi/cuda_handlers.cu)
target_include_directories(jaxflash_cuda PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
target_include_directories(jaxflash_cuda SYSTEM PRIVATE ${XLA_FFI_INCLUDE_DIR})
set_target_properties(jaxflash_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON CUDA_SEPARABLE_COMPILATION OFF)
target_compile_options(jaxflash_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-O3 --use_fast_math -lineinfo>)
target_link_libraries(jaxflash_cuda PUBLIC CUDA::cudart_static)

target_compile_definitions(_native PRIVATE JAXFLASH_WITH_CUDA)
target_link_libraries(_native PRIVATE jaxflash_cuda)
