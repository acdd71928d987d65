// Which of this build's kernels a device runs (host side): both directions
// have sm_90a kernels (wgmma, TMA) beside the sm_80 ones.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace jaxflash::gpu {

// A kernel with no body: its attributes tell which code of this build a
// device would run.
template <int = 0>
__global__ void sm90a_probe() {}

// Whether `device` runs this build's sm_90a code: compute capability 9.0
// and a build for it (JAXFLASH_CUDA_ARCHITECTURES has 90a; a plain 90 does
// not compile, primitives/wgmma.h). A build without it runs sm_80 code, or
// PTX compiled from it, on a Hopper GPU: the probe kernel's PTX version
// says which. Cached per device.
inline cudaError_t runs_sm90a_code(int device, bool* runs) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  if (major != 9 || minor != 0) {
    *runs = false;
    return cudaSuccess;
  }
  if (device >= 0 && device < kMaxDevices && cache[device].load(std::memory_order_relaxed) != 0) {
    *runs = cache[device].load(std::memory_order_relaxed) == 2;
    return cudaSuccess;
  }
  cudaFuncAttributes attr;
  if ((err = cudaFuncGetAttributes(&attr, sm90a_probe<>)) != cudaSuccess) return err;
  *runs = attr.ptxVersion >= 90;
  if (device >= 0 && device < kMaxDevices) cache[device].store(*runs ? 2 : 1, std::memory_order_relaxed);
  return cudaSuccess;
}

}  // namespace jaxflash::gpu
