#include "cuda/cpu/isa.h"

namespace jaxflash::cpu {

const char* instruction_sets() {
#if defined(JAXFLASH_CPU_NATIVE)
  return "-march=native: the building machine's CPU";
#elif defined(JAXFLASH_CPU_CLONES)
  // The same order of preference as the loader's choice among the target_clones.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "portable; runs its x86-64-v4 (AVX-512) clone";
  if (__builtin_cpu_supports("x86-64-v3")) return "portable; runs its x86-64-v3 (AVX2) clone";
  if (__builtin_cpu_supports("avx")) return "portable; runs its AVX clone";
  return "portable; runs its baseline clone";
#else
  return "portable: the architecture's baseline";
#endif
}

}  // namespace jaxflash::cpu
