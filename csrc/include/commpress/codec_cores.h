// Per-element cores of the sign and QSGD codecs, shared by the CPU and CUDA kernels.
//
// The specification is the pure-torch reference in commpress/codecs/{sign,qsgd}.py; each
// function below is one element of it, with the same operations in the same precision, so the
// kernels agree with it bit for bit. T is the storage dtype, CT = Elem<T>::compute the
// arithmetic type (float32, or float64 for float64 input), which is also the residual dtype.
#pragma once

#include <cstdint>

#include "commpress/hd.h"

namespace commpress {

// Error feedback input: c = x.to(CT) + e (or x alone), and w = c rounded to x's dtype, the
// value that is actually encoded (commpress/feedback.py: corrected, wire_input).
template <class T, bool HasE>
struct Corrected {
  using CT = typename Elem<T>::compute;
  CT c;
  CT w;
  COMMPRESS_HD Corrected(T x, const CT* e, int64_t i) {
    if constexpr (HasE) {
      c = Elem<T>::load(x) + e[i];
      w = round_trip<T>(c);
    } else {
      c = Elem<T>::load(x);
      w = c;
    }
  }
};

// What torch's `zeros(dtype).add_(v.to(dtype))` leaves: v rounded to T, with -0 made +0.
// Decoding into a fresh output adds to +0; error feedback subtracts exactly this value.
template <class T>
COMMPRESS_HD typename Elem<T>::compute decoded_value(typename Elem<T>::compute v) {
  using CT = typename Elem<T>::compute;
  return round_trip<T>(v) + CT(0);
}

// out += v.to(T) in T's arithmetic (float for the 16-bit formats), like torch's add_.
template <class T>
COMMPRESS_HD T accumulate(T out, typename Elem<T>::compute v) {
  return Elem<T>::store(Elem<T>::load(out) + Elem<T>::load(Elem<T>::store(v)));
}

// The decoded element written to out: added to it, or stored as a fresh decode into zeros would
// leave it (v rounded to T, -0 as +0).
template <bool Accumulate, class T>
COMMPRESS_HD T decode_into(T out, typename Elem<T>::compute v) {
  if constexpr (Accumulate) {
    return accumulate<T>(out, v);
  } else {
    (void)out;
    return Elem<T>::store(decoded_value<T>(v));
  }
}

// ----- sign ------------------------------------------------------------------------------
// Bit 1 for w < 0 (so 0 and -0 decode to +scale); decoded element = +-scale.
template <class CT>
COMMPRESS_HD CT sign_value(bool negative, CT scale) {
  return negative ? -scale : scale;
}

// ----- qsgd ------------------------------------------------------------------------------
// Stochastic rounding in 24-bit fixed point (commpress/codecs/qsgd.py), per bucket of norm n:
//   p = 2**64 if n < 2**-64 else 1,  r = (s * (2**24 - 4)) / (n * p)  (0 when n == 0),
// then per element T = floor((w * p) * r) (signed) and field = (T + v + s * 2**24) >> 24, v the
// element's 24-bit uniform (rng_u24_paired). w * p is exact; each product is rounded on its
// own. The margin of 4 in r keeps |T| < s * 2**24, so the field is in [0, 2s] with no clamp.
constexpr int kQsgdFractionBits = 24;

template <class CT>
struct QsgdScale {
  CT p;  // exact power-of-two pre-scale: 1, or 2**64 for buckets whose r would overflow
  CT r;  // (s * (2**24 - 4)) / (n * p), correctly rounded; 0 for an all-zero bucket

  COMMPRESS_HD QsgdScale(CT norm, int s) {
    p = norm < CT(0x1p-64) ? CT(0x1p64) : CT(1);
    r = norm > CT(0)
            ? static_cast<CT>(static_cast<int64_t>(s) * ((int64_t{1} << kQsgdFractionBits) - 4)) /
                  mul_rn(norm, p)
            : CT(0);
  }
};

// s * 2**24: the offset that makes the fixed-point level non-negative.
COMMPRESS_HD uint32_t qsgd_offset(int s) { return static_cast<uint32_t>(s) << kQsgdFractionBits; }

// Field in [0, 2s] of w with uniform v: floor((T + v) / 2**24) + s, T = floor((w * p) * r).
// |T| < s * 2**24 < 2**31; the sum is formed mod 2**32, where its true value lies.
template <class CT>
COMMPRESS_HD uint32_t qsgd_fixed_field(CT w, QsgdScale<CT> sc, uint32_t v, int s) {
  const CT y = mul_rn(mul_rn(w, sc.p), sc.r);
  // floor without <cmath> (NVRTC has none): truncate, then step down where that rounded up.
  // The float of the truncated value is exact: below 2**23 any integer is, above y is one.
  const auto truncated = static_cast<int32_t>(y);
  const int32_t fixed = truncated - (static_cast<CT>(truncated) > y ? 1 : 0);
  return (static_cast<uint32_t>(fixed) + v + qsgd_offset(s)) >> kQsgdFractionBits;
}

// Decoded element of a field: norm * ((field - s) / s), each step rounded in CT. `ratio` is
// (field - s) / s, precomputed per field value by the kernels (same division, same result).
template <class CT>
COMMPRESS_HD CT qsgd_ratio(uint32_t field, int s) {
  return (static_cast<CT>(field) - static_cast<CT>(s)) / static_cast<CT>(s);
}

template <class CT>
COMMPRESS_HD CT qsgd_value(CT norm, CT ratio) {
  return mul_rn(norm, ratio);
}

// ----- blockint (int8 / int4) ----------------------------------------------------------
// Block-scaled symmetric integers (commpress/spec/blockint.py): per block, s = amax / q_max
// in CT (0 for an all-zero block); per element field = clamp(rne(w / safe), -q_max, q_max)
// + q_max with safe = s > 0 ? s : 1; decoded element = (field - q_max) * s.

// 1.5 * 2**(mantissa bits): (v + k) - k is v rounded to an integer, ties to even, in the
// default rounding mode, for |v| < 2**22 (float) / 2**51 (double). Two IEEE operations, so no
// <cmath> (NVRTC has none) and the same bits as torch.round on every ISA.
template <class CT>
struct RneMagic;
template <>
struct RneMagic<float> {
  static constexpr float k = 12582912.0f;
};
template <>
struct RneMagic<double> {
  static constexpr double k = 6755399441055744.0;
};

// rne(v) for the quotients of the encode: |w / safe| <= amax / s < 2 * q_max + 1 when s > 0
// (s is amax / q_max correctly rounded, or a subnormal within a factor 2 of it), and
// |w| < q_max * 2**-149 when s underflows to 0 (safe = 1).
template <class CT>
COMMPRESS_HD CT rne_small(CT v) {
  return (v + RneMagic<CT>::k) - RneMagic<CT>::k;
}

template <class CT>
COMMPRESS_HD uint8_t blockint_field(CT w, CT safe, int qmax) {
  const CT q = rne_small<CT>(w / safe);
  const CT hi = static_cast<CT>(qmax);
  const CT c = q < -hi ? -hi : (q > hi ? hi : q);
  return static_cast<uint8_t>(static_cast<int>(c) + qmax);
}

// Stochastic rounding (blockint_encode_sr, commpress/spec/blockint.py encode_stochastic_reference),
// in 24-bit fixed point like QSGD: r = clamp(w / safe, -q_max, q_max), T = floor(r * 2**24) (the
// product exact: a power of two), field = (T + v + q_max * 2**24) >> 24 with v the element's
// 24-bit uniform (rng_u24_paired). |T| <= q_max * 2**24, so the field is in [0, 2 q_max] with no
// clamp after the rounding, and E[field - q_max] = T / 2**24, within 2**-24 of r.
template <class CT>
COMMPRESS_HD uint8_t blockint_field_sr(CT w, CT safe, int qmax, uint32_t v) {
  const CT hi = static_cast<CT>(qmax);
  CT r = w / safe;
  r = r < -hi ? -hi : (r > hi ? hi : r);
  const CT y = r * static_cast<CT>(16777216);
  const auto truncated = static_cast<int32_t>(y);
  const int32_t fixed = truncated - (static_cast<CT>(truncated) > y ? 1 : 0);
  return static_cast<uint8_t>(
      (static_cast<uint32_t>(fixed) + v + (static_cast<uint32_t>(qmax) << 24)) >> 24);
}

// Decoded element of a field: (field - q_max) * s, the subtraction exact, the product rounded.
template <class CT>
COMMPRESS_HD CT blockint_value(uint32_t field, CT scale, int qmax) {
  return mul_rn(static_cast<CT>(field) - static_cast<CT>(qmax), scale);
}

// ----- ternary (commpress/spec/ternary.py) --------------------------------------------------
// Levels q in {-1, 0, 1} of a block scaled to its absmax s (float32): the stochastic rounding
// of blockint_field_sr with q_max = 1 (field q + 1 in {0, 1, 2}, s = amax / 1 = amax), the
// fields packed five per byte in base 3, the first element the least significant digit. Past
// the last element (the padding of the last block and of the last byte) the field is 1 (q = 0).
constexpr int kTernaryPerByte = 5;
// 3**5 - 1: the largest valid byte (five fields of 2).
constexpr int kTernaryMaxByte = 242;
// The byte of five fields of 1 (level 0): the padding past the last element.
constexpr uint8_t kTernaryZeroByte = 1 + 3 + 9 + 27 + 81;

// The byte of five fields f[0..5) (each 0-2): sum f[k] * 3**k, at most 242.
COMMPRESS_HD constexpr uint8_t ternary_byte(uint32_t f0, uint32_t f1, uint32_t f2, uint32_t f3, uint32_t f4) {
  return static_cast<uint8_t>(f0 + 3u * (f1 + 3u * (f2 + 3u * (f3 + 3u * f4))));
}

// Digit k (0-4) of a byte in base 3: the field of its element k (any byte value: a byte above
// 242 gives the specification's wrong but in-range digits, never an out-of-range one).
COMMPRESS_HD constexpr uint32_t ternary_digit(uint32_t byte, int k) {
  for (int j = 0; j < k; ++j) {
    byte /= 3u;
  }
  return byte % 3u;
}

}  // namespace commpress
