// Host/device basics shared by every kernel: the inline macro, bit casts, the dtype codes of
// the C launchers and exact float16/bfloat16 conversions.
//
// Plain C++17, no torch and no CUDA headers beyond what nvcc provides: compiles with g++ and
// with nvcc. Every function here is exact (integer bit manipulation or a single correctly
// rounded IEEE operation), so the CPU kernels, the CUDA kernels and torch agree bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define COMMPRESS_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// always_inline: the per-element cores must inline into the vectorised loops of every ISA
// variant (csrc/cpu/kernels_*.cpp); an out-of-line copy is never called.
#define COMMPRESS_HD inline __attribute__((always_inline))
#else
#define COMMPRESS_HD inline
#endif

namespace commpress {

// dtype codes of the C launchers (csrc/cuda/*.cu) and the CPU kernel tables.
enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };

// `device` in device code, `host` elsewhere: the intrinsics below exist only on the device.
#if defined(__CUDA_ARCH__)
#define COMMPRESS_DEVICE_OR_HOST(device, host) (device)
#else
#define COMMPRESS_DEVICE_OR_HOST(device, host) (host)
#endif

#if !defined(__CUDA_ARCH__)  // host only (NVRTC compiles no host functions)
// The bits of `from` as a `To` (memcpy: the defined way before C++20 bit_cast).
template <typename To, typename From>
inline To host_bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit casts keep the size");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}
#endif

COMMPRESS_HD uint32_t float_bits(float f) {
  return COMMPRESS_DEVICE_OR_HOST(__float_as_uint(f), host_bit_cast<uint32_t>(f));
}

COMMPRESS_HD float bits_float(uint32_t u) {
  return COMMPRESS_DEVICE_OR_HOST(__uint_as_float(u), host_bit_cast<float>(u));
}

COMMPRESS_HD uint64_t double_bits(double d) {
  return COMMPRESS_DEVICE_OR_HOST(static_cast<uint64_t>(__double_as_longlong(d)),
                                  host_bit_cast<uint64_t>(d));
}

// Products that must not be fused into a following add/sub (nvcc contracts a * b + c into an
// FMA by default; the CPU build passes -ffp-contract=off): the codecs' reference rounds each.
COMMPRESS_HD float mul_rn(float a, float b) {
  return COMMPRESS_DEVICE_OR_HOST(__fmul_rn(a, b), a * b);
}

COMMPRESS_HD double mul_rn(double a, double b) {
  return COMMPRESS_DEVICE_OR_HOST(__dmul_rn(a, b), a * b);
}

// Storage types of the 16-bit formats: the raw bits, like c10::Half / c10::BFloat16.
struct Half {
  uint16_t x;
};
struct BFloat16 {
  uint16_t x;
};

// float16 -> float32, exact (subnormals included).
COMMPRESS_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) {
    return bits_float(sign | 0x7F800000u | (mant << 13));
  }
  if (exp != 0) {
    return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }
  if (mant == 0) {
    return bits_float(sign);
  }
  // Subnormal: value = mant * 2^-24, exactly representable as a float32 normal.
  int e = 113;  // exponent field of 2^-14
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return bits_float(sign | (static_cast<uint32_t>(e) << 23) | ((mant & 0x3FFu) << 13));
}

// float32 -> float16, round to nearest even (what torch's .to(torch.float16) does).
COMMPRESS_HD uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {  // inf / nan (quiet)
    return static_cast<uint16_t>(sign | 0x7C00u | (x > 0x7F800000u ? 0x200u : 0u));
  }
  if (x >= 0x477FF000u) {  // >= 65520 rounds to inf
    return static_cast<uint16_t>(sign | 0x7C00u);
  }
  if (x >= 0x38800000u) {  // result is a normal half
    uint32_t h = ((x >> 23) - 112u) << 10 | ((x >> 13) & 0x3FFu);
    const uint32_t rem = x & 0x1FFFu;
    h += (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ? 1u : 0u;
    return static_cast<uint16_t>(sign | h);
  }
  // Subnormal half (or zero): round mant * 2^(e - 126) to an integer, ties to even.
  const uint32_t e = x >> 23;
  if (e < 101) {  // below 2^-25 (or exactly... see shift >= 25): rounds to zero
    return sign;
  }
  const uint32_t m = (x & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14 .. 25
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  q += (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign | q);
}

// bfloat16 -> float32, exact.
COMMPRESS_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// float32 -> bfloat16, round to nearest even (c10::BFloat16's rule, NaN -> 0x7FC0).
COMMPRESS_HD uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return 0x7FC0u;
  }
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// Element traits: the storage type T, its compute type (float for the 16-bit formats and
// float32, double for float64 -- the codecs' `compute_dtype`) and exact conversions.
template <class T>
struct Elem;

// A storage type that is its own compute type (float32, float64): load and store copy.
template <class T>
struct SameElem {
  using compute = T;
  static COMMPRESS_HD T load(T v) { return v; }
  static COMMPRESS_HD T store(T v) { return v; }
};

template <>
struct Elem<float> : SameElem<float> {
  static constexpr float kMax = 3.4028234663852886e38f;
};

template <>
struct Elem<double> : SameElem<double> {
  static constexpr double kMax = 1.7976931348623157e308;
};

// The 16-bit formats stay spelled out: a template over their conversion functions (called
// through constant function pointers) changed GCC's code for the CPU kernels.
template <>
struct Elem<Half> {
  using compute = float;
  static COMMPRESS_HD float load(Half v) { return half_to_float(v.x); }
  static COMMPRESS_HD Half store(float v) { return Half{float_to_half(v)}; }
  static constexpr float kMax = 65504.0f;
};

template <>
struct Elem<BFloat16> {
  using compute = float;
  static COMMPRESS_HD float load(BFloat16 v) { return bf16_to_float(v.x); }
  static COMMPRESS_HD BFloat16 store(float v) { return BFloat16{float_to_bf16(v)}; }
  static constexpr float kMax = 3.3895313892515355e38f;
};

// Rounds a compute-type value to the storage type and back (w = c.to(x.dtype) in torch).
template <class T>
COMMPRESS_HD typename Elem<T>::compute round_trip(typename Elem<T>::compute v) {
  return Elem<T>::load(Elem<T>::store(v));
}

}  // namespace commpress
