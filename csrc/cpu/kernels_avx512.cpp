// The avx512 variant of the CPU inner loops (see kernels_impl.h), chosen at run time when the
// CPU supports it. Built only for x86-64 with GCC or Clang; elsewhere the table is null.
#include "kernels_includes.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi,bmi2,f16c,popcnt"))), apply_to = function)
#else
#pragma GCC push_options
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_*().
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi,bmi2,f16c,popcnt")
#endif

#define COMMPRESS_ISA_NS isa_avx512
#define COMMPRESS_ISA_NAME "avx512"
#define COMMPRESS_ISA_LEVEL 3
#include "kernels_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace commpress {
namespace cpu {
extern const Kernels* const avx512_table;
const Kernels* const avx512_table = &isa_avx512::table;
}  // namespace cpu
}  // namespace commpress

#else

namespace commpress {
namespace cpu {
extern const Kernels* const avx512_table;
const Kernels* const avx512_table = nullptr;
}  // namespace cpu
}  // namespace commpress

#endif
