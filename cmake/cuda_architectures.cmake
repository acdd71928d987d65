# Decides JAXFLASH_CUDA_BUILD_ARCHITECTURES: the CUDA architectures to compile, or empty for a
# CPU-only build. Every architecture costs minutes of nvcc and tens of MB of extension, so
# "auto" builds only what can run here: the visible GPUs' architectures, or the ones asked for.
#
#   JAXFLASH_CUDA   nvcc found, GPU visible   nvcc found, no GPU        no nvcc
#   auto            the GPUs' architectures   CPU only, unless          CPU only
#                                             JAXFLASH_CUDA_ARCHITECTURES
#   ON              the GPUs' architectures   80;90a                    error
#   OFF             CPU only
# JAXFLASH_CUDA_ARCHITECTURES, when given, replaces the GPUs' architectures in every row.
set(JAXFLASH_CUDA_BUILD_ARCHITECTURES "")
string(TOUPPER "${JAXFLASH_CUDA}" cuda_mode)
if(NOT cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "jaxflash: JAXFLASH_CUDA must be auto, ON or OFF, not '${JAXFLASH_CUDA}'")
endif()
if(cuda_mode STREQUAL "OFF")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "jaxflash: JAXFLASH_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
  message(STATUS "jaxflash: no CUDA compiler (nvcc) found: CPU-only build")
  return()
endif()

# The visible GPUs' architectures. Hopper (9.0) needs the arch-specific sm_90a for wgmma and
# TMA; the kernels need at least 8.0 (bf16 mma.sync, cp.async).
set(visible_architectures "")
set(too_old "")
find_program(NVIDIA_SMI nvidia-smi)
if(NVIDIA_SMI)
  execute_process(COMMAND ${NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                  OUTPUT_VARIABLE compute_caps OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE smi_result ERROR_QUIET)
  if(smi_result EQUAL 0)
    string(REPLACE "\n" ";" compute_caps "${compute_caps}")
    foreach(cap IN LISTS compute_caps)
      string(STRIP "${cap}" cap)
      if(NOT cap MATCHES "^([0-9]+)\\.([0-9]+)$")
        continue()
      endif()
      set(arch "${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
      if(arch LESS 80)
        list(APPEND too_old "${cap}")
        continue()
      endif()
      if(arch EQUAL 90)
        set(arch 90a)
      endif()
      list(APPEND visible_architectures ${arch})
    endforeach()
    list(REMOVE_DUPLICATES visible_architectures)
  endif()
endif()
if(too_old)
  message(STATUS "jaxflash: GPUs of compute capability ${too_old} are older than the CUDA kernels need (8.0); not built for")
endif()

if(JAXFLASH_CUDA_ARCHITECTURES)
  set(JAXFLASH_CUDA_BUILD_ARCHITECTURES "${JAXFLASH_CUDA_ARCHITECTURES}")
elseif(visible_architectures)
  set(JAXFLASH_CUDA_BUILD_ARCHITECTURES "${visible_architectures}")
elseif(cuda_mode STREQUAL "ON")
  set(JAXFLASH_CUDA_BUILD_ARCHITECTURES "80;90a")
else()
  message(STATUS "jaxflash: nvcc found but no GPU visible: CPU-only build. To build the CUDA kernels "
                 "anyway, set JAXFLASH_CUDA=ON (for 80;90a) or JAXFLASH_CUDA_ARCHITECTURES (e.g. 90a)")
endif()
