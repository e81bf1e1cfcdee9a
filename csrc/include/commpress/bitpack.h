// Bit-field packing cores shared by the CPU kernels and the CUDA kernels.
//
// Layout (the specification is commpress/bitpack.py): n fields, each Bits wide with Bits in
// {1, 2, 4, 8}, are packed LSB-first into ceil(n * Bits / 8) bytes; field i lives in byte
// (i * Bits) / 8 at bit offset (i * Bits) % 8, and the unused high bits of the last byte are
// zero. Because Bits divides 8, a byte never straddles two fields, so every output byte (when
// packing) and every field (when unpacking) can be computed independently of the others.
//
// Plain C++17, no torch and no CUDA headers: compiles with g++ and with nvcc.
#pragma once

#include <cstdint>

#include "commpress/hd.h"

namespace commpress {

// Number of Bits-wide fields held by one packed byte.
template <int Bits>
constexpr int kFieldsPerByte = 8 / Bits;

// Bytes that n fields of `bits` bits occupy once packed: ceil(n * bits / 8), computed
// without forming n * bits so that no n >= 0 overflows (bits in {1, 2, 4, 8}).
COMMPRESS_HD constexpr int64_t packed_nbytes(int64_t n, int64_t bits) {
  const int64_t per_byte = 8 / bits;
  return n / per_byte + (n % per_byte != 0);
}

// Packs `count` fields (1 <= count <= kFieldsPerByte<Bits>) starting at `fields` into one
// byte. Missing trailing fields leave their bits zero, which is the required padding.
// `seen` is OR-ed with every field read, so a caller detects a field >= 2**Bits with one test
// (seen >> Bits) != 0 after a whole run instead of a second pass over the input.
template <int Bits>
COMMPRESS_HD constexpr uint8_t pack_fields(const uint8_t* fields, int count, uint8_t& seen) {
  unsigned byte = 0;
  for (int j = 0; j < count; ++j) {
    seen |= fields[j];
    byte |= static_cast<unsigned>(fields[j]) << (j * Bits);
  }
  return static_cast<uint8_t>(byte);
}

// Writes the first `count` fields (count <= kFieldsPerByte<Bits>) held by `byte` to `out`.
template <int Bits>
COMMPRESS_HD constexpr void unpack_fields(uint8_t byte, uint8_t* out, int count) {
  constexpr unsigned kMask = (1u << Bits) - 1u;
  for (int j = 0; j < count; ++j) {
    out[j] = static_cast<uint8_t>((byte >> (j * Bits)) & kMask);
  }
}

// Field `i` of a packed stream.
template <int Bits>
COMMPRESS_HD constexpr uint8_t unpack_field(const uint8_t* packed, int64_t i) {
  constexpr unsigned kMask = (1u << Bits) - 1u;
  const int shift = static_cast<int>(i % kFieldsPerByte<Bits>) * Bits;
  return static_cast<uint8_t>((packed[i / kFieldsPerByte<Bits>] >> shift) & kMask);
}

}  // namespace commpress
