// The baseline variant of the CPU inner loops (the compiler's default target), and the choice
// of the variant to use on the running CPU.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels_includes.h"

#define COMMPRESS_ISA_NS isa_default
#define COMMPRESS_ISA_NAME "default"
#define COMMPRESS_ISA_LEVEL 0
#include "kernels_impl.h"
#undef COMMPRESS_ISA_NS
#undef COMMPRESS_ISA_NAME
#undef COMMPRESS_ISA_LEVEL

namespace commpress {
namespace cpu {

// Defined by kernels_avx2.cpp / kernels_avx512.cpp; null when that variant was not built
// (non-x86 target or a compiler without target pragmas).
extern const Kernels* const avx2_table;
extern const Kernels* const avx512_table;

namespace {

bool cpu_has(const char* isa) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __builtin_cpu_init();
  if (std::string(isa) == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi2");
  }
  if (std::string(isa) == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi2");
  }
#else
  (void)isa;
#endif
  return false;
}

const Kernels* table_named(const std::string& name) {
  if (name == "default") {
    return &isa_default::table;
  }
  if (name == "avx2") {
    return avx2_table != nullptr && cpu_has("avx2") ? avx2_table : nullptr;
  }
  if (name == "avx512") {
    return avx512_table != nullptr && cpu_has("avx512") ? avx512_table : nullptr;
  }
  return nullptr;
}

const Kernels* best_table() {
  // COMMPRESS_CPU_ISA=default|avx2|avx512 pins a variant (benchmarks, bisecting).
  if (const char* forced = std::getenv("COMMPRESS_CPU_ISA")) {
    if (const Kernels* t = table_named(forced)) {
      return t;
    }
  }
  for (const char* name : {"avx512", "avx2"}) {
    if (const Kernels* t = table_named(name)) {
      return t;
    }
  }
  return &isa_default::table;
}

std::atomic<const Kernels*>& active() {
  static std::atomic<const Kernels*> table{best_table()};
  return table;
}

}  // namespace

const Kernels& kernels() { return *active().load(std::memory_order_acquire); }

std::string select_isa(const std::string& name) {
  if (!name.empty()) {
    const Kernels* t = table_named(name);
    if (t == nullptr) {
      throw std::invalid_argument("cpu_isa: '" + name +
                                  "' is not available here (available: " + available_isas() +
                                  ")");
    }
    active().store(t, std::memory_order_release);
  }
  return kernels().isa;
}

std::string available_isas() {
  std::string out = "default";
  for (const char* name : {"avx2", "avx512"}) {
    if (table_named(name) != nullptr) {
      out += std::string(",") + name;
    }
  }
  return out;
}

}  // namespace cpu
}  // namespace commpress
