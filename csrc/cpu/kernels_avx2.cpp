// The avx2 variant of the CPU inner loops (see kernels_impl.h), chosen at run time when the
// CPU supports it. Built only for x86-64 with GCC or Clang; elsewhere the table is null.
#include "kernels_includes.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi,bmi2,f16c,popcnt"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2,f16c,popcnt")
#endif

#define COMMPRESS_ISA_NS isa_avx2
#define COMMPRESS_ISA_NAME "avx2"
#define COMMPRESS_ISA_LEVEL 2
#include "kernels_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace commpress {
namespace cpu {
extern const Kernels* const avx2_table;
const Kernels* const avx2_table = &isa_avx2::table;
}  // namespace cpu
}  // namespace commpress

#else

namespace commpress {
namespace cpu {
extern const Kernels* const avx2_table;
const Kernels* const avx2_table = nullptr;
}  // namespace cpu
}  // namespace commpress

#endif
