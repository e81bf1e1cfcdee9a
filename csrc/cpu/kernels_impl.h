// Inner loops of the CPU kernels (see kernels.h), compiled once per instruction set.
//
// Included by kernels_<isa>.cpp after its `#pragma GCC target`, inside a namespace named by
// COMMPRESS_ISA_NS; everything here has internal linkage, so the variants never mix. The
// loops are written for the auto-vectoriser: fixed-size tiles, no calls, branch-free bodies.
// No torch headers: the per-element math comes from include/commpress/*.h.
//
// Every header this file needs is included by the .cpp *before* its target pragma, so no
// inline function outside the ISA namespace is ever compiled for a wider instruction set.

// NOLINTBEGIN(build/namespaces)
namespace commpress {
namespace cpu {
namespace COMMPRESS_ISA_NS {
namespace {

template <class T>
using CT = typename Elem<T>::compute;

constexpr int64_t kTile = 512;  // elements per pass-2 tile: field buffer stays in L1

// |v| (clears the sign bit: -0.0 -> +0.0, like torch.abs).
COMMPRESS_HD float fabs_(float v) { return std::fabs(v); }
COMMPRESS_HD double fabs_(double v) { return std::fabs(v); }

#if COMMPRESS_ISA_LEVEL >= 3
#define COMMPRESS_AVX512 1
#else
#define COMMPRESS_AVX512 0
#endif

#if COMMPRESS_AVX512
// ----- AVX-512 float32 fast paths ------------------------------------------------------------
// The same operations as the generic loops below, on 16 lanes; the ISA test loop in
// tests/test_kernels.py checks them against the reference bit for bit.

inline __m512 load_c16(const float* __restrict__ x, const float* __restrict__ e, int64_t i,
                       bool has_e) {
  const __m512 v = _mm512_loadu_ps(x + i);
  return has_e ? _mm512_add_ps(v, _mm512_loadu_ps(e + i)) : v;
}

// The sums of 8 consecutive full chunks (256 values) combined by the adjacent-pairs tree:
// ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7)). The per-chunk halves trees of all 8
// chunks are folded together with lane shuffles (same operand pairs as chunk_tree_sum).
template <int Kind, bool HasE>
inline double chunk8_sum_f32(const float* __restrict__ x, const float* __restrict__ e, int64_t i) {
  __m512d b[8];  // per chunk: v[j] + v[j + 8] + ... folded down to 8 lanes (levels 16 and 8)
  for (int k = 0; k < 8; ++k) {
    const __m512 w0 = load_c16(x, e, i + 32 * k, HasE);
    const __m512 w1 = load_c16(x, e, i + 32 * k + 16, HasE);
    __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(w0));
    __m512d d1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(w0, 1));
    __m512d d2 = _mm512_cvtps_pd(_mm512_castps512_ps256(w1));
    __m512d d3 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(w1, 1));
    if constexpr (Kind == kSumAbs) {
      d0 = _mm512_abs_pd(d0);
      d1 = _mm512_abs_pd(d1);
      d2 = _mm512_abs_pd(d2);
      d3 = _mm512_abs_pd(d3);
    } else {
      d0 = _mm512_mul_pd(d0, d0);
      d1 = _mm512_mul_pd(d1, d1);
      d2 = _mm512_mul_pd(d2, d2);
      d3 = _mm512_mul_pd(d3, d3);
    }
    b[k] = _mm512_add_pd(_mm512_add_pd(d0, d2), _mm512_add_pd(d1, d3));
  }
  // level 4: c_k = b_k[0..3] + b_k[4..7], two chunks per register
  __m512d c[4];
  for (int k = 0; k < 4; ++k) {
    const __m512d lo = _mm512_shuffle_f64x2(b[2 * k], b[2 * k + 1], 0x44);  // b0[0..3], b1[0..3]
    const __m512d hi = _mm512_shuffle_f64x2(b[2 * k], b[2 * k + 1], 0xEE);  // b0[4..7], b1[4..7]
    c[k] = _mm512_add_pd(lo, hi);
  }
  // level 2: d_k = c_k[0..1] + c_k[2..3], four chunks per register
  __m512d d[2];
  for (int k = 0; k < 2; ++k) {
    const __m512d lo = _mm512_shuffle_f64x2(c[2 * k], c[2 * k + 1], 0x88);  // 128-bit lanes 0, 2
    const __m512d hi = _mm512_shuffle_f64x2(c[2 * k], c[2 * k + 1], 0xDD);  // 128-bit lanes 1, 3
    d[k] = _mm512_add_pd(lo, hi);
  }
  // level 1: r_k = d_k[0] + d_k[1]; lanes come out as chunks 0, 4, 1, 5, 2, 6, 3, 7
  const __m512d r = _mm512_add_pd(_mm512_unpacklo_pd(d[0], d[1]), _mm512_unpackhi_pd(d[0], d[1]));
  alignas(64) double rs[8];
  _mm512_store_pd(rs, r);
  return ((rs[0] + rs[2]) + (rs[4] + rs[6])) + ((rs[1] + rs[3]) + (rs[5] + rs[7]));
}

// Sign bits (and the residual) of [s, s + 16m), s a multiple of 16; returns where it stopped.
template <bool HasE>
inline int64_t sign_encode_f32(const float* __restrict__ x, float* __restrict__ e, float sc,
                               uint8_t* __restrict__ bits, int64_t s, int64_t end) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 pos = _mm512_set1_ps(sc);
  const __m512 neg = _mm512_set1_ps(-sc);
  int64_t i = s;
  for (; i + 16 <= end; i += 16) {
    const __m512 c = load_c16(x, e, i, HasE);
    const __mmask16 m = _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ);
    const auto mb = static_cast<uint16_t>(m);
    std::memcpy(bits + i / 8, &mb, 2);
    if constexpr (HasE) {
      const __m512 d = _mm512_add_ps(_mm512_mask_blend_ps(m, pos, neg), zero);
      _mm512_storeu_ps(e + i, _mm512_sub_ps(c, d));
    }
  }
  return i;
}

template <bool Accumulate>
inline int64_t sign_decode_f32(const uint8_t* __restrict__ bits, float sc, float* __restrict__ out,
                               int64_t s, int64_t end) {
  const __m512 pos = _mm512_set1_ps(sc);
  const __m512 neg = _mm512_set1_ps(-sc);
  int64_t i = s;
  for (; i + 16 <= end; i += 16) {
    uint16_t mb;
    std::memcpy(&mb, bits + i / 8, 2);
    const __m512 v = _mm512_mask_blend_ps(static_cast<__mmask16>(mb), pos, neg);
    // out + v, or v + 0 (a fresh decode adds to zeros: -0 becomes +0)
    const __m512 base = Accumulate ? _mm512_loadu_ps(out + i) : _mm512_setzero_ps();
    _mm512_storeu_ps(out + i, _mm512_add_ps(base, v));
  }
  return i;
}

inline __m512i mix64_x8(__m512i z) {
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ull)));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBull)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// rng_u24_paired of the 16 elements whose 8 draws have the Weyl states (key + (j + 1) * golden)
// in z, OR-ed with `offset` (bits 24 and up): the 32-bit lanes of the draws are the elements'
// halves in order (little-endian), so this is one ternary-logic op after the hash.
inline __m512i u24_paired_x16(__m512i z, __m512i offset) {
  return _mm512_ternarylogic_epi32(mix64_x8(z), _mm512_set1_epi32(0xFFFFFF), offset, 0xEA);  // (a & b) | c
}

// Packs 16 fields (int32 lanes, each < 2**Bits) LSB-first into 2 * Bits bytes.
template <int Bits>
inline void store_fields16(__m512i f, uint8_t* __restrict__ out) {
  if constexpr (Bits == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(f));
  } else if constexpr (Bits == 4) {
    // fields 2k, 2k + 1 are the halves of 64-bit lane k: shift the high one down to bit 4
    const __m512i pairs = _mm512_or_si512(f, _mm512_srli_epi64(f, 28));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(pairs));
  } else {
    const __m512i sh = _mm512_set_epi32(6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0);
    __m128i b = _mm512_cvtepi32_epi8(_mm512_sllv_epi32(f, sh));
    b = _mm_or_si128(b, _mm_srli_epi32(b, 8));
    b = _mm_or_si128(b, _mm_srli_epi32(b, 16));
    b = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const auto word = static_cast<uint32_t>(_mm_cvtsi128_si32(b));
    std::memcpy(out, &word, 4);
  }
}

// The 16 fields (int32 lanes) packed at `p` (2 * Bits bytes).
template <int Bits>
inline __m512i load_fields16(const uint8_t* __restrict__ p) {
  if constexpr (Bits == 8) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (Bits == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
  } else {
    uint32_t word;
    std::memcpy(&word, p, 4);
    const __m128i rep = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(word)),
                                         _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
    const __m512i sh = _mm512_set_epi32(6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0);
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(rep), sh), _mm512_set1_epi32(3));
  }
}

// Packs 32 fields (f0: fields 0..15, f1: 16..31, int32 lanes < 2**Bits) into 4 * Bits bytes.
template <int Bits>
inline void store_fields32(__m512i f0, __m512i f1, uint8_t* __restrict__ out) {
  if constexpr (Bits == 4) {
    // packus: 128-bit lane L holds the words f0[4L..4L+3], f1[4L..4L+3]; madd joins adjacent
    // words into w0 + 16 * w1 = one packed byte per dword, which vpmovdb narrows and one
    // in-register shuffle puts in element order (lane L gave bytes 2L, 2L+1, 8+2L, 9+2L).
    const __m512i pairs =
        _mm512_madd_epi16(_mm512_packus_epi32(f0, f1), _mm512_set1_epi32(0x00100001));
    const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_shuffle_epi8(_mm512_cvtepi32_epi8(pairs), order));
  } else {
    store_fields16<Bits>(f0, out);
    store_fields16<Bits>(f1, out + 2 * Bits);
  }
}

// The QSGD encode of one bucket segment on 16 float32 lanes: the same operations as
// qsgd_elems (fixed point, paired 24-bit uniforms), checked bit for bit by the ISA loop of
// tests/test_kernels.py.
template <bool HasE, int Bits>
struct QsgdF32 {
  const float* __restrict__ x;
  float* __restrict__ e;
  const float* ratio16;
  __m512i vs;     // s in every lane
  __m512i offset; // s * 2**24 in every lane (qsgd_offset)
  __m512 vnorm;   // n
  __m512 vp;      // QsgdScale::p
  __m512 vr;      // QsgdScale::r
  bool tiny;      // p != 1: the exact pre-scale of a bucket norm below 2**-64
  __m512i z;      // Weyl states (key + (j + 1) * golden) of the next 8 draws (16 elements)

  // Fields of elements [i, i + 16) (their draws are z's); with a residual, updates it.
  inline __m512i fields16(int64_t i) {
    const __m512 c = load_c16(x, e, i, HasE);
    const __m512 w = tiny ? _mm512_mul_ps(c, vp) : c;
    // floor by the conversion's own rounding mode (exact, like the scalar floor)
    const __m512i fixed = _mm512_cvt_roundps_epi32(_mm512_mul_ps(w, vr),
                                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512i v = u24_paired_x16(z, offset);
    z = _mm512_add_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(8 * kGolden)));
    const __m512i f = _mm512_srli_epi32(_mm512_add_epi32(fixed, v), kQsgdFractionBits);
    if constexpr (HasE) {
      // ratio (f - s) / s: a 16-entry table lookup for fields of 2 and 4 bits
      const __m512 ratio =
          Bits == 8 ? _mm512_div_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(f, vs)), _mm512_cvtepi32_ps(vs))
                    : _mm512_permutexvar_ps(f, _mm512_loadu_ps(ratio16));
      const __m512 d = _mm512_add_ps(_mm512_mul_ps(vnorm, ratio), _mm512_setzero_ps());
      _mm512_storeu_ps(e + i, _mm512_sub_ps(c, d));
    }
    return f;
  }
};

// Fields (and the residual) of [s, s + 16m), s a multiple of 16; returns where it stopped.
// With `ahead` > 0, prefetches x one line per 16 elements, `ahead` elements on (below n).
template <bool HasE, int Bits>
inline int64_t qsgd_encode_f32(const float* __restrict__ x, float* __restrict__ e, float norm,
                               int levels, const float* ratio16, uint64_t key,
                               uint8_t* __restrict__ packed, int64_t s, int64_t end,
                               int64_t ahead, int64_t n) {
  const QsgdScale<float> sc(norm, levels);
  alignas(64) uint64_t start[8];
  for (int l = 0; l < 8; ++l) {
    start[l] = key + static_cast<uint64_t>(s / 2 + 1 + l) * kGolden;
  }
  QsgdF32<HasE, Bits> k{x,
                        e,
                        ratio16,
                        _mm512_set1_epi32(levels),
                        _mm512_set1_epi32(static_cast<int>(qsgd_offset(levels))),
                        _mm512_set1_ps(norm),
                        _mm512_set1_ps(sc.p),
                        _mm512_set1_ps(sc.r),
                        sc.p != 1.0f,
                        _mm512_load_si512(start)};
  const int64_t prefetch_end = ahead > 0 ? n - ahead : 0;
  int64_t i = s;
  for (; i + 32 <= end; i += 32) {
    if (i < prefetch_end) {
      _mm_prefetch(reinterpret_cast<const char*>(x + i + ahead), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(x + i + 16 + ahead), _MM_HINT_T1);
    }
    const __m512i f0 = k.fields16(i);
    const __m512i f1 = k.fields16(i + 16);
    store_fields32<Bits>(f0, f1, packed + i / 8 * Bits);
  }
  if (i + 16 <= end) {
    store_fields16<Bits>(k.fields16(i), packed + i / 8 * Bits);
    i += 16;
  }
  return i;
}

template <bool Accumulate, int Bits>
inline int64_t qsgd_decode_f32(const uint8_t* __restrict__ packed, float norm, int levels,
                               const float* ratio16, float* __restrict__ out, int64_t s,
                               int64_t end) {
  const __m512 vs = _mm512_set1_ps(static_cast<float>(levels));
  const __m512 vnorm = _mm512_set1_ps(norm);
  const __m512 table = _mm512_loadu_ps(ratio16);
  int64_t i = s;
  for (; i + 16 <= end; i += 16) {
    const __m512i f = load_fields16<Bits>(packed + i / 8 * Bits);
    __m512 ratio;
    if constexpr (Bits == 8) {
      ratio = _mm512_div_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(f), vs), vs);
    } else {
      ratio = _mm512_permutexvar_ps(f, table);
    }
    const __m512 base = Accumulate ? _mm512_loadu_ps(out + i) : _mm512_setzero_ps();
    _mm512_storeu_ps(out + i, _mm512_add_ps(base, _mm512_mul_ps(vnorm, ratio)));
  }
  return i;
}
#endif  // COMMPRESS_AVX512

// Whether the float32 fast paths apply: T is float32 and every block segment of a range
// starting at a multiple of 64 starts at a multiple of 16.
template <class T>
COMMPRESS_HD bool use_fast(int64_t block, int64_t n) {
  return COMMPRESS_AVX512 && std::is_same_v<T, float> && (block % 16 == 0 || block >= n);
}

template <class T, bool HasE>
COMMPRESS_HD CT<T> encoded_value(const T* __restrict__ x, const CT<T>* __restrict__ e,
                                 int64_t i) {
  return Corrected<T, HasE>(x[i], e, i).w;
}

// ----- pass 1: block sums --------------------------------------------------------------------

template <int Kind, class T, bool HasE>
COMMPRESS_HD double element_term(const T* __restrict__ x, const CT<T>* __restrict__ e, int64_t i,
                                 double safe) {
  const double w = static_cast<double>(encoded_value<T, HasE>(x, e, i));
  if constexpr (Kind == kSumAbs || Kind == kMaxAbs) {
    return std::fabs(w);
  } else if constexpr (Kind == kSumSquare) {
    return w * w;  // exact for float32/16 input
  } else {
    const double y = w / safe;
    return y * y;
  }
}

template <class T, bool HasE>
bool has_nonfinite(const T* __restrict__ x, const CT<T>* __restrict__ e, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const double w = static_cast<double>(encoded_value<T, HasE>(x, e, i));
    if (!(std::fabs(w) <= std::numeric_limits<double>::max())) {
      return true;
    }
  }
  return false;
}

// Sum of 8 full chunks (256 values) by the vector path where one exists (float32 input, sums
// of |w| or w^2); false otherwise.
template <int Kind, class T, bool HasE>
COMMPRESS_HD bool fast_chunk8_sum(const T* __restrict__ x, const CT<T>* __restrict__ e, int64_t i,
                                  double* out) {
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float> && (Kind == kSumAbs || Kind == kSumSquare)) {
    *out = chunk8_sum_f32<Kind, HasE>(x, e, i);
    return true;
  }
#endif
  (void)x, (void)e, (void)i, (void)out;
  return false;
}

// The sign bits of [s, end) (w < 0, LSB-first) at bits + s / 8, s a multiple of 8 and
// end - s <= 256: what the sign encode's second pass writes, computed by the block-sum pass
// while the span is in L1 when there is no residual to update (the bits do not depend on the
// scale). The AVX-512 compare is sign_encode_f32's; the scalar loop is sign_elems' test.
template <class T, bool HasE>
void sign_bits_span(const T* __restrict__ x, const CT<T>* __restrict__ e,
                    uint8_t* __restrict__ bits, int64_t s, int64_t end) {
  int64_t i = s;
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float>) {
    const __m512 zero = _mm512_setzero_ps();
    for (; i + 16 <= end; i += 16) {
      const auto m =
          static_cast<uint16_t>(_mm512_cmp_ps_mask(load_c16(x, e, i, HasE), zero, _CMP_LT_OQ));
      std::memcpy(bits + i / 8, &m, 2);
    }
  }
#endif
  const int64_t count = end - i;
  if (count <= 0) {
    return;
  }
  alignas(64) uint8_t neg[8 * kSumChunk];
  for (int64_t j = 0; j < count; ++j) {
    neg[j] = encoded_value<T, HasE>(x, e, i + j) < CT<T>(0);
  }
  uint8_t seen = 0;
  for (int64_t q = 0; q * 8 < count; ++q) {
    const int len = count - q * 8 < 8 ? static_cast<int>(count - q * 8) : 8;
    bits[i / 8 + q] = pack_fields<1>(neg + q * 8, len, seen);
  }
}

template <int Kind, class T, bool HasE>
void sum_groups(const SumArgs& a, int64_t g0, int64_t g1, double* out, std::atomic<bool>* bad) {
  const T* __restrict__ x = static_cast<const T*>(a.x);
  const CT<T>* __restrict__ e = static_cast<const CT<T>*>(a.e);
  const BlockLayout& L = a.layout;
  bool saw_bad = false;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t b = g / L.groups_per_block;
    const int64_t bstart = b * L.block;
    const int64_t bend = bstart + L.block_len(b);
    const int64_t s = bstart + (g - b * L.groups_per_block) * L.group;
    const int64_t t = s + L.group < bend ? s + L.group : bend;
    double safe = 1.0;
    if constexpr (Kind == kSumScaledSquare) {
      safe = a.amax[b] > 0.0 ? a.amax[b] : 1.0;
    }
    if constexpr (Kind == kMaxAbs) {
      double m = 0.0;
      int64_t i = s;
      for (; i + kSumChunk <= t; i += kSumChunk) {
        double v[kSumChunk];
        for (int j = 0; j < kSumChunk; ++j) {
          v[j] = element_term<Kind, T, HasE>(x, e, i + j, safe);
        }
        double cm = v[0];
        for (int j = 1; j < kSumChunk; ++j) {
          cm = v[j] > cm ? v[j] : cm;
        }
        if (!(cm <= std::numeric_limits<double>::max())) {
          saw_bad = saw_bad || has_nonfinite<T, HasE>(x, e, i, i + kSumChunk);
        }
        m = cm > m ? cm : m;
      }
      for (; i < t; ++i) {
        const double v = element_term<Kind, T, HasE>(x, e, i, safe);
        if (!(v <= std::numeric_limits<double>::max())) {
          saw_bad = true;
        }
        m = v > m ? v : m;
      }
      out[g] = m;
    } else {
      // Groups of 8 chunks (aligned subtrees of the order; a missing chunk counts as 0),
      // pushed as one value each, so the stack works once per 256 elements.
      constexpr int64_t kSpan = 8 * kSumChunk;
      PairwiseStack stack;
      for (int64_t i = s; i < t; i += kSpan) {
        const int64_t count = t - i;
        double sub;
        if (count >= kSpan && fast_chunk8_sum<Kind, T, HasE>(x, e, i, &sub)) {
          // done by the vector path
        } else {
          double cs[8];
          for (int k = 0; k < 8; ++k) {
            const int64_t c0 = i + k * kSumChunk;
            const int64_t left = t - c0;
            double v[kSumChunk];
            if (left >= kSumChunk) {
              for (int j = 0; j < kSumChunk; ++j) {
                v[j] = element_term<Kind, T, HasE>(x, e, c0 + j, safe);
              }
              cs[k] = chunk_tree_sum(v);
            } else if (left > 0) {
              for (int j = 0; j < kSumChunk; ++j) {
                v[j] = j < left ? element_term<Kind, T, HasE>(x, e, c0 + j, safe) : 0.0;
              }
              cs[k] = chunk_tree_sum(v);
            } else {
              cs[k] = 0.0;
            }
          }
          sub = ((cs[0] + cs[1]) + (cs[2] + cs[3])) + ((cs[4] + cs[5]) + (cs[6] + cs[7]));
        }
        // A non-finite w makes the sum Inf or NaN; a finite float64 sum can overflow too, so
        // look at the elements before calling it non-finite input.
        if (!(sub <= std::numeric_limits<double>::max())) {
          saw_bad = saw_bad || has_nonfinite<T, HasE>(x, e, i, i + (count < kSpan ? count : kSpan));
        }
        if constexpr (Kind == kSumAbs) {
          if (a.bits != nullptr) {
            sign_bits_span<T, HasE>(x, e, a.bits, i, i + (count < kSpan ? count : kSpan));
          }
        }
        stack.push(sub);
      }
      out[g] = stack.finish();
    }
  }
  if (saw_bad) {
    bad->store(true, std::memory_order_relaxed);
  }
}

// ----- packing a tile of fields ----------------------------------------------------------------

// Packs `count` fields (count <= kTile) to ceil(count * Bits / 8) bytes at `out`.
template <int Bits>
COMMPRESS_HD void pack_tile(const uint8_t* __restrict__ fields, int64_t count,
                            uint8_t* __restrict__ out) {
  constexpr int kPer = kFieldsPerByte<Bits>;
  const int64_t full = count / kPer;
  uint8_t seen = 0;
  for (int64_t q = 0; q < full; ++q) {
    out[q] = pack_fields<Bits>(fields + q * kPer, kPer, seen);
  }
  const int tail = static_cast<int>(count - full * kPer);
  if (tail > 0) {
    out[full] = pack_fields<Bits>(fields + full * kPer, tail, seen);
  }
}

template <int Bits>
COMMPRESS_HD void unpack_tile(const uint8_t* __restrict__ packed, int64_t count,
                              uint8_t* __restrict__ fields) {
  constexpr int kPer = kFieldsPerByte<Bits>;
  const int64_t full = count / kPer;
  for (int64_t q = 0; q < full; ++q) {
    unpack_fields<Bits>(packed[q], fields + q * kPer, kPer);
  }
  const int tail = static_cast<int>(count - full * kPer);
  if (tail > 0) {
    unpack_fields<Bits>(packed[full], fields + full * kPer, tail);
  }
}

// Calls body(segment_start, segment_end, block_index) for the block segments of [i0, i1).
template <class Body>
COMMPRESS_HD void for_segments(int64_t i0, int64_t i1, int64_t block, Body&& body) {
  int64_t i = i0;
  while (i < i1) {
    const int64_t b = i / block;
    const int64_t end = (b + 1) * block < i1 ? (b + 1) * block : i1;
    body(i, end, b);
    i = end;
  }
}

// ----- sign --------------------------------------------------------------------------------------

// Sign bits of [s, end) into tile[s .. end) (0/1 bytes) and, with a residual, e = c - decode(w).
template <class T, bool HasE>
COMMPRESS_HD void sign_elems(const T* __restrict__ x, CT<T>* __restrict__ e, CT<T> sc,
                             uint8_t* __restrict__ tile, int64_t s, int64_t end) {
  for (int64_t i = s; i < end; ++i) {
    const Corrected<T, HasE> v(x[i], e, i);
    const bool ng = v.w < CT<T>(0);
    tile[i] = ng;
    if constexpr (HasE) {
      e[i] = v.c - decoded_value<T>(sign_value(ng, sc));
    }
  }
}

template <class T, bool HasE>
void sign_encode_range(const SignArgs& a, int64_t i0, int64_t i1) {
  const T* __restrict__ x = static_cast<const T*>(a.x);
  CT<T>* __restrict__ e = static_cast<CT<T>*>(a.e);
  const CT<T>* __restrict__ scales = static_cast<const CT<T>*>(a.scales);
  alignas(64) uint8_t neg[kTile];
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (use_fast<T>(a.block, a.n) && i0 % 16 == 0) {
      for_segments(i0, i1, a.block, [&](int64_t s, int64_t end, int64_t b) {
        const int64_t i = sign_encode_f32<HasE>(x, e, scales[b], a.bits, s, end);
        if (i < end) {  // the last < 16 elements of the tensor; i is a multiple of 16
          sign_elems<T, HasE>(x, e, scales[b], neg - i, i, end);
          pack_tile<1>(neg, end - i, a.bits + i / 8);
        }
      });
      return;
    }
  }
#endif
  for (int64_t t0 = i0; t0 < i1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < i1 ? t0 + kTile : i1;
    for_segments(t0, t1, a.block, [&](int64_t s, int64_t end, int64_t b) {
      sign_elems<T, HasE>(x, e, scales[b], neg - t0, s, end);
    });
    pack_tile<1>(neg, t1 - t0, a.bits + t0 / 8);
  }
}

template <bool Acc, class T>
COMMPRESS_HD void sign_decode_elems(const uint8_t* __restrict__ tile, CT<T> sc, T* __restrict__ out,
                                    int64_t s, int64_t end) {
  for (int64_t i = s; i < end; ++i) {
    out[i] = decode_into<Acc, T>(out[i], sign_value(tile[i] != 0, sc));
  }
}

template <class T, bool Acc>
void sign_decode_range_impl(const SignDecodeArgs& a, int64_t i0, int64_t i1) {
  const CT<T>* __restrict__ scales = static_cast<const CT<T>*>(a.scales);
  T* __restrict__ out = static_cast<T*>(a.out);
  alignas(64) uint8_t neg[kTile];
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (use_fast<T>(a.block, a.n) && i0 % 16 == 0) {
      for_segments(i0, i1, a.block, [&](int64_t s, int64_t end, int64_t b) {
        const int64_t i = sign_decode_f32<Acc>(a.bits, scales[b], out, s, end);
        if (i < end) {
          unpack_tile<1>(a.bits + i / 8, end - i, neg);
          sign_decode_elems<Acc, T>(neg - i, scales[b], out, i, end);
        }
      });
      return;
    }
  }
#endif
  for (int64_t t0 = i0; t0 < i1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < i1 ? t0 + kTile : i1;
    unpack_tile<1>(a.bits + t0 / 8, t1 - t0, neg);
    for_segments(t0, t1, a.block, [&](int64_t s, int64_t end, int64_t b) {
      sign_decode_elems<Acc, T>(neg - t0, scales[b], out, s, end);
    });
  }
}

template <class T>
void sign_decode_range(const SignDecodeArgs& a, int64_t i0, int64_t i1) {
  if (a.accumulate) {
    sign_decode_range_impl<T, true>(a, i0, i1);
  } else {
    sign_decode_range_impl<T, false>(a, i0, i1);
  }
}

// ----- qsgd --------------------------------------------------------------------------------------

// Fields of [s, end) into tile[s .. end) and, with a residual, e = c - decode(w).
template <class T, bool HasE>
COMMPRESS_HD void qsgd_elems(const T* __restrict__ x, CT<T>* __restrict__ e, CT<T> norm, int levels,
                             const CT<T>* ratio, uint64_t key, uint8_t* __restrict__ tile,
                             int64_t s, int64_t end) {
  const QsgdScale<CT<T>> sc(norm, levels);
  for (int64_t i = s; i < end; ++i) {
    const Corrected<T, HasE> v(x[i], e, i);
    const uint32_t u = rng_u24_paired(key, static_cast<uint64_t>(i));
    const uint32_t f = qsgd_fixed_field(v.w, sc, u, levels);
    tile[i] = static_cast<uint8_t>(f);
    if constexpr (HasE) {
      e[i] = v.c - decoded_value<T>(qsgd_value(norm, ratio[f]));
    }
  }
}

// ratio[f] = (f - s) / s for every byte value f, as the reference computes it. Every byte has
// an entry, so even fields above 2s (which the wire decoder rejects) decode like the reference
// does and never index past the table.
template <class C>
void fill_qsgd_ratios(C (&ratio)[256], int levels) {
  for (int f = 0; f < 256; ++f) {
    ratio[f] = qsgd_ratio<C>(static_cast<uint32_t>(f), levels);
  }
}

template <class T, bool HasE, int Bits>
void qsgd_encode_range(const QsgdArgs& a, int64_t i0, int64_t i1) {
  const T* __restrict__ x = static_cast<const T*>(a.x);
  CT<T>* __restrict__ e = static_cast<CT<T>*>(a.e);
  const CT<T>* __restrict__ norms = static_cast<const CT<T>*>(a.norms);
  const int levels = a.levels;
  CT<T> ratio[256];
  fill_qsgd_ratios(ratio, levels);
  alignas(64) uint8_t fields[kTile];
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (use_fast<T>(a.bucket, a.n) && i0 % 16 == 0) {
      for_segments(i0, i1, a.bucket, [&](int64_t s, int64_t end, int64_t b) {
        const int64_t i = qsgd_encode_f32<HasE, Bits>(x, e, norms[b], levels, ratio, a.key,
                                                      a.packed, s, end, a.prefetch_ahead, a.n);
        if (i < end) {
          qsgd_elems<T, HasE>(x, e, norms[b], levels, ratio, a.key, fields - i, i, end);
          pack_tile<Bits>(fields, end - i, a.packed + i / 8 * Bits);
        }
      });
      return;
    }
  }
#endif
  for (int64_t t0 = i0; t0 < i1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < i1 ? t0 + kTile : i1;
    for_segments(t0, t1, a.bucket, [&](int64_t s, int64_t end, int64_t b) {
      qsgd_elems<T, HasE>(x, e, norms[b], levels, ratio, a.key, fields - t0, s, end);
    });
    pack_tile<Bits>(fields, t1 - t0, a.packed + t0 / 8 * Bits);
  }
}

template <bool Acc, class T>
COMMPRESS_HD void qsgd_decode_elems(const uint8_t* __restrict__ tile, CT<T> norm,
                                    const CT<T>* ratio, T* __restrict__ out, int64_t s,
                                    int64_t end) {
  for (int64_t i = s; i < end; ++i) {
    out[i] = decode_into<Acc, T>(out[i], qsgd_value(norm, ratio[tile[i]]));
  }
}

template <class T, int Bits, bool Acc>
void qsgd_decode_range_impl(const QsgdDecodeArgs& a, int64_t i0, int64_t i1) {
  const CT<T>* __restrict__ norms = static_cast<const CT<T>*>(a.norms);
  T* __restrict__ out = static_cast<T*>(a.out);
  const int levels = a.levels;
  CT<T> ratio[256];
  fill_qsgd_ratios(ratio, levels);
  alignas(64) uint8_t fields[kTile];
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (use_fast<T>(a.bucket, a.n) && i0 % 16 == 0) {
      for_segments(i0, i1, a.bucket, [&](int64_t s, int64_t end, int64_t b) {
        const int64_t i =
            qsgd_decode_f32<Acc, Bits>(a.packed, norms[b], levels, ratio, out, s, end);
        if (i < end) {
          unpack_tile<Bits>(a.packed + i / 8 * Bits, end - i, fields);
          qsgd_decode_elems<Acc, T>(fields - i, norms[b], ratio, out, i, end);
        }
      });
      return;
    }
  }
#endif
  for (int64_t t0 = i0; t0 < i1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < i1 ? t0 + kTile : i1;
    unpack_tile<Bits>(a.packed + t0 / 8 * Bits, t1 - t0, fields);
    for_segments(t0, t1, a.bucket, [&](int64_t s, int64_t end, int64_t b) {
      qsgd_decode_elems<Acc, T>(fields - t0, norms[b], ratio, out, s, end);
    });
  }
}

template <class T, int Bits>
void qsgd_decode_range(const QsgdDecodeArgs& a, int64_t i0, int64_t i1) {
  if (a.accumulate) {
    qsgd_decode_range_impl<T, Bits, true>(a, i0, i1);
  } else {
    qsgd_decode_range_impl<T, Bits, false>(a, i0, i1);
  }
}

// ----- top-k -------------------------------------------------------------------------------------

template <class T>
int64_t topk_compact(const void* xv, int64_t i0, int64_t i1, double threshold, int64_t* idx,
                     double* mag, int64_t cap, std::atomic<bool>* bad) {
  const T* __restrict__ x = static_cast<const T*>(xv);
  const CT<T> thr = static_cast<CT<T>>(threshold);
  constexpr int kStep = 16;
  int64_t count = 0;
  bool nonfinite = false;
  auto keep = [&](int64_t i, CT<T>) {
    if (count < cap) {
      idx[count] = i;
      if (mag != nullptr) {
        mag[count] = static_cast<double>(Elem<T>::load(x[i]));
      }
    }
    ++count;
  };
  int64_t i = i0;
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float>) {
    const __m512 vthr = _mm512_set1_ps(thr);
    const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    __mmask16 nf = 0;
    for (; i + 16 <= i1; i += 16) {
      const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + i));
      nf |= _mm512_cmp_ps_mask(v, inf, _CMP_NLT_UQ);  // Inf or NaN
      unsigned hit = _mm512_cmp_ps_mask(v, vthr, _CMP_GE_OQ);
      if (hit != 0) {
        alignas(64) float m[16];
        _mm512_store_ps(m, v);
        for (; hit != 0; hit &= hit - 1) {
          const int j = __builtin_ctz(hit);
          keep(i + j, m[j]);
        }
      }
    }
    nonfinite |= nf != 0;
  }
#endif
  for (; i + kStep <= i1; i += kStep) {
    CT<T> m[kStep];
    bool any = false;
    bool nf = false;
    for (int j = 0; j < kStep; ++j) {
      m[j] = fabs_(Elem<T>::load(x[i + j]));
      any |= m[j] >= thr;
      nf |= !(m[j] <= Elem<T>::kMax);
    }
    nonfinite |= nf;
    if (any) {
      for (int j = 0; j < kStep; ++j) {
        if (m[j] >= thr) {
          keep(i + j, m[j]);
        }
      }
    }
  }
  for (; i < i1; ++i) {
    const CT<T> m = fabs_(Elem<T>::load(x[i]));
    nonfinite |= !(m <= Elem<T>::kMax);
    if (m >= thr) {
      keep(i, m);
    }
  }
  if (nonfinite) {
    bad->store(true, std::memory_order_relaxed);
  }
  return count;
}

// ----- blockint (int8 / int4) --------------------------------------------------------------------

#if COMMPRESS_AVX512
// max |x| of the float32 block segment [s, end), s a multiple of 16 (the < 16 tail in scalar);
// sets *nonfinite when one is NaN or Inf.
inline float blockint_amax_f32(const float* __restrict__ x, int64_t s, int64_t end,
                               bool* nonfinite) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 m0 = _mm512_setzero_ps();
  __m512 m1 = _mm512_setzero_ps();
  __mmask16 nf = 0;
  int64_t i = s;
  for (; i + 32 <= end; i += 32) {
    const __m512 v0 = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    const __m512 v1 = _mm512_abs_ps(_mm512_loadu_ps(x + i + 16));
    nf |= _mm512_cmp_ps_mask(v0, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(v1, inf, _CMP_NLT_UQ);
    m0 = _mm512_max_ps(m0, v0);
    m1 = _mm512_max_ps(m1, v1);
  }
  if (i + 16 <= end) {
    const __m512 v0 = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    nf |= _mm512_cmp_ps_mask(v0, inf, _CMP_NLT_UQ);
    m0 = _mm512_max_ps(m0, v0);
    i += 16;
  }
  float m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  bool bad = nf != 0;
  for (; i < end; ++i) {
    const float v = fabs_(x[i]);
    bad |= !(v <= Elem<float>::kMax);
    m = v > m ? v : m;
  }
  *nonfinite |= bad;
  return m;
}

// Fields of the float32 segment [s, s + 16m), s a multiple of 16, packed at their place;
// returns where it stopped. The same operations as blockint_field on 16 lanes.
// Sr: stochastic rounding (blockint_field_sr), element i's uniform from draw i / 2 of `key`.
template <int Bits, bool Sr>
inline int64_t blockint_encode_f32(const float* __restrict__ x, float safe, int qmax, uint64_t key,
                                   uint8_t* __restrict__ packed, int64_t s, int64_t end) {
  const __m512 vs = _mm512_set1_ps(safe);
  const __m512 hi = _mm512_set1_ps(static_cast<float>(qmax));
  const __m512 lo = _mm512_set1_ps(-static_cast<float>(qmax));
  __m512i z = _mm512_setzero_si512();
  if constexpr (Sr) {
    // Weyl states of the 8 draws of elements [s, s + 16): key + (s / 2 + 1 + l) * golden
    alignas(64) uint64_t start[8];
    for (int l = 0; l < 8; ++l) {
      start[l] = key + static_cast<uint64_t>(s / 2 + 1 + l) * kGolden;
    }
    z = _mm512_load_si512(start);
  }
  const __m512i offset = _mm512_set1_epi32(qmax << 24);
  auto fields16 = [&](int64_t i) {
    if constexpr (Sr) {
      const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs), lo), hi);
      // floor by the conversion's own rounding mode; r * 2**24 is exact
      const __m512i fixed = _mm512_cvt_roundps_epi32(_mm512_mul_ps(r, _mm512_set1_ps(16777216.0f)),
                                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      const __m512i v = u24_paired_x16(z, offset);  // v + q_max * 2**24
      z = _mm512_add_epi64(z, _mm512_set1_epi64(static_cast<int64_t>(8 * kGolden)));
      return _mm512_srli_epi32(_mm512_add_epi32(fixed, v), 24);
    } else {
      const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 c = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
      return _mm512_cvtps_epi32(_mm512_add_ps(c, hi));  // an exact integer: no rounding
    }
  };
  int64_t i = s;
  for (; i + 32 <= end; i += 32) {
    const __m512i f0 = fields16(i);  // in order: each call advances the draws (Sr)
    const __m512i f1 = fields16(i + 16);
    store_fields32<Bits>(f0, f1, packed + i / 8 * Bits);
  }
  if (i + 16 <= end) {
    store_fields16<Bits>(fields16(i), packed + i / 8 * Bits);
    i += 16;
  }
  return i;
}

template <bool Accumulate, int Bits>
inline int64_t blockint_decode_f32(const uint8_t* __restrict__ packed, float sc, int qmax,
                                   float* __restrict__ out, int64_t s, int64_t end) {
  const __m512 vs = _mm512_set1_ps(sc);
  const __m512 vq = _mm512_set1_ps(static_cast<float>(qmax));
  int64_t i = s;
  for (; i + 16 <= end; i += 16) {
    const __m512i f = load_fields16<Bits>(packed + i / 8 * Bits);
    const __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(f), vq), vs);
    // out + v, or v + 0 (a fresh decode adds to zeros: -0 becomes +0)
    const __m512 base = Accumulate ? _mm512_loadu_ps(out + i) : _mm512_setzero_ps();
    _mm512_storeu_ps(out + i, _mm512_add_ps(base, v));
  }
  return i;
}
#endif  // COMMPRESS_AVX512

// max |x| of [s, end) in the compute dtype; sets *nonfinite when one is NaN or Inf.
template <class T>
COMMPRESS_HD CT<T> blockint_amax(const T* __restrict__ x, int64_t s, int64_t end,
                                 bool* nonfinite) {
  constexpr int kStep = 16;
  CT<T> m = CT<T>(0);
  bool bad = false;
  int64_t i = s;
  for (; i + kStep <= end; i += kStep) {
    CT<T> v[kStep];
    for (int j = 0; j < kStep; ++j) {
      v[j] = fabs_(Elem<T>::load(x[i + j]));
      bad |= !(v[j] <= std::numeric_limits<CT<T>>::max());
    }
    for (int j = 0; j < kStep; ++j) {
      m = v[j] > m ? v[j] : m;
    }
  }
  for (; i < end; ++i) {
    const CT<T> v = fabs_(Elem<T>::load(x[i]));
    bad |= !(v <= std::numeric_limits<CT<T>>::max());
    m = v > m ? v : m;
  }
  *nonfinite |= bad;
  return m;
}

template <class T, bool Sr>
COMMPRESS_HD void blockint_elems(const T* __restrict__ x, CT<T> safe, int qmax, uint64_t key,
                                 uint8_t* __restrict__ tile, int64_t s, int64_t end) {
  for (int64_t i = s; i < end; ++i) {
    if constexpr (Sr) {
      tile[i] = blockint_field_sr<CT<T>>(Elem<T>::load(x[i]), safe, qmax,
                                         rng_u24_paired(key, static_cast<uint64_t>(i)));
    } else {
      tile[i] = blockint_field<CT<T>>(Elem<T>::load(x[i]), safe, qmax);
    }
  }
}

template <class T, int Bits, bool Sr>
bool blockint_encode_blocks(const BlockIntEncodeArgs& a, int64_t b0, int64_t b1, double* top) {
  const T* __restrict__ x = static_cast<const T*>(a.x);
  CT<T>* __restrict__ scales = static_cast<CT<T>*>(a.scales);
  const CT<T> qm = static_cast<CT<T>>(a.qmax);
  const bool fast = use_fast<T>(a.block, a.n);
  bool bad = false;
  CT<T> largest = CT<T>(0);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b * a.block;
    const int64_t end = s + a.block < a.n ? s + a.block : a.n;
    CT<T> m;
#if COMMPRESS_AVX512
    if constexpr (std::is_same_v<T, float>) {
      m = fast ? blockint_amax_f32(x, s, end, &bad) : blockint_amax<T>(x, s, end, &bad);
    } else {
      m = blockint_amax<T>(x, s, end, &bad);
    }
#else
    m = blockint_amax<T>(x, s, end, &bad);
#endif
    const CT<T> sc = m / qm;
    scales[b] = sc;
    largest = sc > largest ? sc : largest;
  }
  *top = static_cast<double>(largest);
  if (bad) {
    return false;  // the op raises; fields of NaN/Inf are never converted
  }
  const int64_t i0 = b0 * a.block;
  const int64_t i1 = b1 * a.block < a.n ? b1 * a.block : a.n;
  alignas(64) uint8_t fields[kTile];
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (fast && i0 % 16 == 0) {
      for_segments(i0, i1, a.block, [&](int64_t s, int64_t end, int64_t b) {
        const float safe = scales[b] > 0.0f ? scales[b] : 1.0f;
        const int64_t i = blockint_encode_f32<Bits, Sr>(x, safe, a.qmax, a.key, a.packed, s, end);
        if (i < end) {  // the last < 16 elements of the tensor; i is a multiple of 16
          blockint_elems<T, Sr>(x, safe, a.qmax, a.key, fields - i, i, end);
          pack_tile<Bits>(fields, end - i, a.packed + i / 8 * Bits);
        }
      });
      return true;
    }
  }
#endif
  (void)fast;
  for (int64_t t0 = i0; t0 < i1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < i1 ? t0 + kTile : i1;
    for_segments(t0, t1, a.block, [&](int64_t s, int64_t end, int64_t b) {
      const CT<T> safe = scales[b] > CT<T>(0) ? scales[b] : CT<T>(1);
      blockint_elems<T, Sr>(x, safe, a.qmax, a.key, fields - t0, s, end);
    });
    // t0 is even but (odd blocks) not always a multiple of 8: the byte offset is t0 * Bits / 8
    pack_tile<Bits>(fields, t1 - t0, a.packed + t0 * Bits / 8);
  }
  return true;
}

template <bool Acc, class T>
COMMPRESS_HD void blockint_decode_elems(const uint8_t* __restrict__ tile, CT<T> sc, int qmax,
                                        T* __restrict__ out, int64_t s, int64_t end) {
  for (int64_t i = s; i < end; ++i) {
    out[i] = decode_into<Acc, T>(out[i], blockint_value<CT<T>>(tile[i], sc, qmax));
  }
}

template <class T, int Bits, bool Acc>
void blockint_decode_range_impl(const BlockIntDecodeArgs& a, int64_t i0, int64_t i1) {
  const CT<T>* __restrict__ scales = static_cast<const CT<T>*>(a.scales);
  T* __restrict__ out = static_cast<T*>(a.out);
  alignas(64) uint8_t fields[kTile];
#if COMMPRESS_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (use_fast<T>(a.block, a.n) && i0 % 16 == 0) {
      for_segments(i0, i1, a.block, [&](int64_t s, int64_t end, int64_t b) {
        const int64_t i = blockint_decode_f32<Acc, Bits>(a.packed, scales[b], a.qmax, out, s, end);
        if (i < end) {
          unpack_tile<Bits>(a.packed + i / 8 * Bits, end - i, fields);
          blockint_decode_elems<Acc, T>(fields - i, scales[b], a.qmax, out, i, end);
        }
      });
      return;
    }
  }
#endif
  for (int64_t t0 = i0; t0 < i1; t0 += kTile) {
    const int64_t t1 = t0 + kTile < i1 ? t0 + kTile : i1;
    unpack_tile<Bits>(a.packed + t0 / 8 * Bits, t1 - t0, fields);
    for_segments(t0, t1, a.block, [&](int64_t s, int64_t end, int64_t b) {
      blockint_decode_elems<Acc, T>(fields - t0, scales[b], a.qmax, out, s, end);
    });
  }
}

template <class T, int Bits>
void blockint_decode_range(const BlockIntDecodeArgs& a, int64_t i0, int64_t i1) {
  if (a.accumulate) {
    blockint_decode_range_impl<T, Bits, true>(a, i0, i1);
  } else {
    blockint_decode_range_impl<T, Bits, false>(a, i0, i1);
  }
}

// ----- ternary (five levels per byte, float32) ---------------------------------------------------

// Elements per tile of the ternary loops: a multiple of 5 (whole bytes) and of 16 (vectors).
constexpr int64_t kTernaryTile = 640;

// Fields (level + 1) of [s, end) into tile[s .. end): blockint_field_sr with q_max = 1, one
// 64-bit draw per pair of elements (the pair 2j, 2j + 1 shares draw j).
inline void ternary_elems(const float* __restrict__ x, float safe, uint64_t key,
                          uint8_t* __restrict__ tile, int64_t s, int64_t end) {
  int64_t i = s;
  if (i < end && (i & 1) != 0) {
    tile[i] = blockint_field_sr<float>(x[i], safe, 1, rng_u24_paired(key, static_cast<uint64_t>(i)));
    ++i;
  }
  for (; i + 2 <= end; i += 2) {
    const uint64_t r = rng_draw(key, static_cast<uint64_t>(i) >> 1);
    tile[i] = blockint_field_sr<float>(x[i], safe, 1, static_cast<uint32_t>(r) & 0xFFFFFFu);
    tile[i + 1] = blockint_field_sr<float>(x[i + 1], safe, 1, static_cast<uint32_t>(r >> 32) & 0xFFFFFFu);
  }
  if (i < end) {
    tile[i] = blockint_field_sr<float>(x[i], safe, 1, rng_u24_paired(key, static_cast<uint64_t>(i)));
  }
}

// The fields of one block segment [s, end): the AVX-512 encode of blockint_encode_sr (Bits 8:
// one field per byte, q_max = 1) from the first multiple of 16, the rest in scalar.
inline void ternary_segment(const float* __restrict__ x, float safe, uint64_t key,
                            uint8_t* __restrict__ tile, int64_t s, int64_t end) {
#if COMMPRESS_AVX512
  const int64_t a = (s + 15) / 16 * 16 < end ? (s + 15) / 16 * 16 : end;
  ternary_elems(x, safe, key, tile, s, a);
  const int64_t i = a < end ? blockint_encode_f32<8, true>(x, safe, 1, key, tile, a, end) : end;
  ternary_elems(x, safe, key, tile, i, end);
#else
  ternary_elems(x, safe, key, tile, s, end);
#endif
}

bool ternary_encode_blocks(const TernaryEncodeArgs& a, int64_t b0, int64_t b1) {
  const float* __restrict__ x = a.x;
  bool bad = false;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b * a.block;
    const int64_t end = s + a.block < a.n ? s + a.block : a.n;
#if COMMPRESS_AVX512
    a.scales[b] = blockint_amax_f32(x, s, end, &bad);  // s = amax / q_max, q_max = 1
#else
    a.scales[b] = blockint_amax<float>(x, s, end, &bad);
#endif
  }
  if (bad) {
    return false;
  }
  const int64_t i0 = b0 * a.block;
  const int64_t e1 = b1 * a.block;  // the padded end of the blocks
  const int64_t real = e1 < a.n ? e1 : a.n;
  alignas(64) uint8_t fields[kTernaryTile];
  int64_t t0 = i0;
  for (; t0 < real; t0 += kTernaryTile) {
    const int64_t t1 = t0 + kTernaryTile < e1 ? t0 + kTernaryTile : e1;
    const int64_t r1 = t1 < a.n ? t1 : a.n;
    uint8_t* tile = fields - t0;  // tile[i] for i in [t0, t1)
    for_segments(t0, r1, a.block, [&](int64_t s, int64_t end, int64_t b) {
      const float safe = a.scales[b] > 0.0f ? a.scales[b] : 1.0f;
      ternary_segment(x, safe, a.key, tile, s, end);
    });
    const int64_t count = (t1 - t0 + kTernaryPerByte - 1) / kTernaryPerByte;  // bytes
    for (int64_t i = r1 - t0; i < count * kTernaryPerByte; ++i) {
      fields[i] = 1;  // level 0 past the last element
    }
    uint8_t* __restrict__ out = a.packed + t0 / kTernaryPerByte;
    for (int64_t q = 0; q < count; ++q) {
      const uint8_t* f = fields + q * kTernaryPerByte;
      out[q] = ternary_byte(f[0], f[1], f[2], f[3], f[4]);
    }
  }
  if (t0 < e1) {  // whole bytes of padding (a block much longer than the tensor)
    const int64_t q0 = t0 / kTernaryPerByte;
    const int64_t q1 = (e1 + kTernaryPerByte - 1) / kTernaryPerByte;
    std::memset(a.packed + q0, kTernaryZeroByte, static_cast<size_t>(q1 - q0));
  }
  return true;
}

// Row b: the levels (digit - 1) of byte b, digits of b in base 3 (for every byte, 243-255 too).
struct TernaryLevels {
  float v[256][kTernaryPerByte];
  constexpr TernaryLevels() : v() {
    for (int b = 0; b < 256; ++b) {
      for (int k = 0; k < kTernaryPerByte; ++k) {
        v[b][k] = static_cast<float>(ternary_digit(static_cast<uint32_t>(b), k)) - 1.0f;
      }
    }
  }
};
constexpr TernaryLevels kTernaryLevels{};

void ternary_decode_range(const TernaryDecodeArgs& a, int64_t i0, int64_t i1) {
  alignas(64) float levels[kTernaryTile];
  for (int64_t t0 = i0; t0 < i1; t0 += kTernaryTile) {
    const int64_t t1 = t0 + kTernaryTile < i1 ? t0 + kTernaryTile : i1;
    const uint8_t* __restrict__ bytes = a.packed + t0 / kTernaryPerByte;
    const int64_t count = (t1 - t0 + kTernaryPerByte - 1) / kTernaryPerByte;
    for (int64_t q = 0; q < count; ++q) {
      std::memcpy(levels + q * kTernaryPerByte, kTernaryLevels.v[bytes[q]],
                  sizeof(float) * kTernaryPerByte);
    }
    const float* lv = levels - t0;
    float* __restrict__ out = a.out;
    for_segments(t0, t1, a.block, [&](int64_t s, int64_t end, int64_t b) {
      const float sc = a.scales[b];
      for (int64_t i = s; i < end; ++i) {
        out[i] = lv[i] * sc;  // IEEE product, as the specification's levels * scale
      }
    });
  }
}

// ----- the table ---------------------------------------------------------------------------------

template <int Kind, class T>
constexpr SumFn sum_entry(bool has_e) {
  return has_e ? &sum_groups<Kind, T, true> : &sum_groups<Kind, T, false>;
}

#define COMMPRESS_SUM_ROW(Kind)                                                               \
  {                                                                                           \
    {sum_entry<Kind, float>(false), sum_entry<Kind, float>(true)},                            \
        {sum_entry<Kind, Half>(false), sum_entry<Kind, Half>(true)},                          \
        {sum_entry<Kind, BFloat16>(false), sum_entry<Kind, BFloat16>(true)},                  \
        {sum_entry<Kind, double>(false), sum_entry<Kind, double>(true)},                      \
  }

#define COMMPRESS_QSGD_ENC(T)                                                                 \
  {                                                                                           \
    {&qsgd_encode_range<T, false, 2>, &qsgd_encode_range<T, false, 4>,                        \
     &qsgd_encode_range<T, false, 8>},                                                        \
        {&qsgd_encode_range<T, true, 2>, &qsgd_encode_range<T, true, 4>,                      \
         &qsgd_encode_range<T, true, 8>},                                                     \
  }

#define COMMPRESS_QSGD_DEC(T) \
  { &qsgd_decode_range<T, 2>, &qsgd_decode_range<T, 4>, &qsgd_decode_range<T, 8> }

#define COMMPRESS_BLOCKINT_ENC(T) \
  { &blockint_encode_blocks<T, 4, false>, &blockint_encode_blocks<T, 8, false> }
#define COMMPRESS_BLOCKINT_ENC_SR(T) \
  { &blockint_encode_blocks<T, 4, true>, &blockint_encode_blocks<T, 8, true> }
#define COMMPRESS_BLOCKINT_DEC(T) \
  { &blockint_decode_range<T, 4>, &blockint_decode_range<T, 8> }

}  // namespace

extern const Kernels table;
const Kernels table = {
    COMMPRESS_ISA_NAME,
    {COMMPRESS_SUM_ROW(kSumAbs), COMMPRESS_SUM_ROW(kSumSquare),
     COMMPRESS_SUM_ROW(kSumScaledSquare), COMMPRESS_SUM_ROW(kMaxAbs)},
    {{&sign_encode_range<float, false>, &sign_encode_range<float, true>},
     {&sign_encode_range<Half, false>, &sign_encode_range<Half, true>},
     {&sign_encode_range<BFloat16, false>, &sign_encode_range<BFloat16, true>},
     {&sign_encode_range<double, false>, &sign_encode_range<double, true>}},
    {&sign_decode_range<float>, &sign_decode_range<Half>, &sign_decode_range<BFloat16>,
     &sign_decode_range<double>},
    {COMMPRESS_QSGD_ENC(float), COMMPRESS_QSGD_ENC(Half), COMMPRESS_QSGD_ENC(BFloat16),
     COMMPRESS_QSGD_ENC(double)},
    {COMMPRESS_QSGD_DEC(float), COMMPRESS_QSGD_DEC(Half), COMMPRESS_QSGD_DEC(BFloat16),
     COMMPRESS_QSGD_DEC(double)},
    {&topk_compact<float>, &topk_compact<Half>, &topk_compact<BFloat16>, &topk_compact<double>},
    {COMMPRESS_BLOCKINT_ENC(float), COMMPRESS_BLOCKINT_ENC(Half),
     COMMPRESS_BLOCKINT_ENC(BFloat16), COMMPRESS_BLOCKINT_ENC(double)},
    {COMMPRESS_BLOCKINT_ENC_SR(float), COMMPRESS_BLOCKINT_ENC_SR(Half),
     COMMPRESS_BLOCKINT_ENC_SR(BFloat16), COMMPRESS_BLOCKINT_ENC_SR(double)},
    {COMMPRESS_BLOCKINT_DEC(float), COMMPRESS_BLOCKINT_DEC(Half),
     COMMPRESS_BLOCKINT_DEC(BFloat16), COMMPRESS_BLOCKINT_DEC(double)},
    &ternary_encode_blocks,
    &ternary_decode_range,
};

#undef COMMPRESS_SUM_ROW
#undef COMMPRESS_QSGD_ENC
#undef COMMPRESS_QSGD_DEC
#undef COMMPRESS_BLOCKINT_ENC
#undef COMMPRESS_BLOCKINT_ENC_SR
#undef COMMPRESS_BLOCKINT_DEC

}  // namespace COMMPRESS_ISA_NS
}  // namespace cpu
}  // namespace commpress
// NOLINTEND(build/namespaces)
