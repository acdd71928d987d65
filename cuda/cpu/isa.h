// Which instruction sets the CPU kernels run with.
//
// The task bodies (all of one Q or K/V tile's work, marked JAXFLASH_CPU_TASK)
// are compiled once per x86-64 level: AVX-512 (x86-64-v4), AVX2 + FMA
// (x86-64-v3) and the baseline. The dynamic loader binds the one this CPU runs
// (an ifunc), so a portable build still runs the wide paths. `flatten` inlines
// everything a body calls, so the whole tile's work is in its clone; what stays
// out of line (operator new, memset) is baseline or libc code, so no AVX
// instruction can reach an older CPU through a shared inline function. CMake
// sets JAXFLASH_CPU_CLONES where the compiler and C library support this. The
// v3 and v4 clones fuse a·b + c into one FMA rounding; the baseline rounds twice,
// so results differ in the last bits between those machines.
#pragma once

#if defined(JAXFLASH_CPU_CLONES)
#define JAXFLASH_CPU_TASK \
  __attribute__((flatten, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "avx", "default")))
#else
#define JAXFLASH_CPU_TASK
#endif

namespace jaxflash::cpu {

// How the CPU kernels were built and, for a portable x86-64 build, which clone
// this CPU runs, e.g. "portable; runs its x86-64-v4 (AVX-512) clone".
const char* instruction_sets();

}  // namespace jaxflash::cpu
