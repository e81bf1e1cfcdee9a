// CPU kernels for commpress::pack_bits / commpress::unpack_bits (schemas in registration.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../checks.h"
#include "commpress/bitpack.h"

namespace commpress {
namespace {

// Packed bytes per parallel_for task; same value as at::internal::GRAIN_SIZE.
constexpr int64_t kGrainBytes = 32768;

// Raises naming the first field that does not fit in `bits` bits. Only called once a pack
// run has seen such a field, so this second, serial pass costs nothing on valid input.
[[noreturn]] void fail_field_out_of_range(const uint8_t* fields, int64_t n, int64_t bits) {
  for (int64_t i = 0; i < n; ++i) {
    if (fields[i] >> bits) {
      TORCH_CHECK(false, "pack_bits: fields[", i, "] = ", static_cast<int>(fields[i]),
                  " does not fit in bits=", bits, " (every field must be < ", 1 << bits, ")");
    }
  }
  TORCH_INTERNAL_ASSERT(false, "pack_bits: out-of-range field reported but not found");
}

// The loops over a range of packed bytes take their pointers as __restrict__ parameters:
// uint8_t stores may alias anything, including pointers a lambda captured by reference, and
// would otherwise force a reload per byte and block vectorisation.
template <int Bits>
uint8_t pack_range(const uint8_t* __restrict__ fields, uint8_t* __restrict__ packed,
                   int64_t begin, int64_t end) {
  constexpr int kPer = kFieldsPerByte<Bits>;
  uint8_t seen = 0;
  for (int64_t b = begin; b < end; ++b) {
    packed[b] = pack_fields<Bits>(fields + b * kPer, kPer, seen);
  }
  return seen;
}

// unpack_fields<Bits> of every byte value, computed at compile time from the shared core.
template <int Bits>
struct UnpackTable {
  uint8_t fields[256][kFieldsPerByte<Bits>] = {};
  constexpr UnpackTable() {
    for (int byte = 0; byte < 256; ++byte) {
      unpack_fields<Bits>(static_cast<uint8_t>(byte), fields[byte], kFieldsPerByte<Bits>);
    }
  }
};
template <int Bits>
constexpr UnpackTable<Bits> kUnpackTable{};

template <int Bits>
void unpack_range(const uint8_t* __restrict__ packed, uint8_t* __restrict__ fields,
                  int64_t begin, int64_t end) {
  constexpr int kPer = kFieldsPerByte<Bits>;
  if constexpr (Bits <= 2) {
    // gcc vectorises the shift loop poorly when one byte fans out to 4 or 8 fields; a table
    // row copy is ~6x (bits=1) and ~3.5x (bits=2) faster. For bits 4 and 8 the loop wins.
    for (int64_t b = begin; b < end; ++b) {
      std::memcpy(fields + b * kPer, kUnpackTable<Bits>.fields[packed[b]], kPer);
    }
  } else {
    for (int64_t b = begin; b < end; ++b) {
      unpack_fields<Bits>(packed[b], fields + b * kPer, kPer);
    }
  }
}

template <int Bits>
void pack_cpu(const uint8_t* fields, int64_t n, uint8_t* packed) {
  constexpr int kPer = kFieldsPerByte<Bits>;
  const int64_t full_bytes = n / kPer;
  std::atomic<bool> out_of_range{false};
  at::parallel_for(0, full_bytes, kGrainBytes, [=, &out_of_range](int64_t begin, int64_t end) {
    if (pack_range<Bits>(fields, packed, begin, end) >> Bits) {
      out_of_range.store(true, std::memory_order_relaxed);
    }
  });
  const int tail = static_cast<int>(n - full_bytes * kPer);
  if (tail > 0) {
    uint8_t seen = 0;
    packed[full_bytes] = pack_fields<Bits>(fields + full_bytes * kPer, tail, seen);
    if (seen >> Bits) {
      out_of_range.store(true, std::memory_order_relaxed);
    }
  }
  if (out_of_range.load(std::memory_order_relaxed)) {
    fail_field_out_of_range(fields, n, Bits);
  }
}

template <int Bits>
void unpack_cpu(const uint8_t* packed, int64_t n, uint8_t* fields) {
  constexpr int kPer = kFieldsPerByte<Bits>;
  const int64_t full_bytes = n / kPer;
  at::parallel_for(0, full_bytes, kGrainBytes, [=](int64_t begin, int64_t end) {
    unpack_range<Bits>(packed, fields, begin, end);
  });
  const int tail = static_cast<int>(n - full_bytes * kPer);
  if (tail > 0) {
    unpack_fields<Bits>(packed[full_bytes], fields + full_bytes * kPer, tail);
  }
}

// Calls f(std::integral_constant<int, Bits>{}) for bits in {1, 2, 4, 8} (check_bits ran first).
template <class F>
void dispatch_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

at::Tensor pack_bits_cpu(const at::Tensor& fields, int64_t bits) {
  check_bits("pack_bits", bits);
  check_byte_vector("pack_bits", "fields", fields, c10::DeviceType::CPU);
  const int64_t n = fields.numel();
  at::Tensor packed = at::empty({packed_nbytes(n, bits)}, fields.options());
  const uint8_t* in = fields.const_data_ptr<uint8_t>();
  uint8_t* out = packed.mutable_data_ptr<uint8_t>();
  dispatch_bits(bits, [&](auto width) { pack_cpu<decltype(width)::value>(in, n, out); });
  return packed;
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed, int64_t bits, int64_t n) {
  check_bits("unpack_bits", bits);
  check_byte_vector("unpack_bits", "packed", packed, c10::DeviceType::CPU);
  TORCH_CHECK(n >= 0, "unpack_bits: n must be >= 0, got ", n);
  const int64_t expected = packed_nbytes(n, bits);
  TORCH_CHECK(packed.numel() == expected, "unpack_bits: packed holds ", packed.numel(),
              " bytes, but n=", n, " fields of bits=", bits, " need ", expected);
  at::Tensor fields = at::empty({n}, packed.options());
  const uint8_t* in = packed.const_data_ptr<uint8_t>();
  uint8_t* out = fields.mutable_data_ptr<uint8_t>();
  dispatch_bits(bits, [&](auto width) { unpack_cpu<decltype(width)::value>(in, n, out); });
  return fields;
}

}  // namespace

TORCH_LIBRARY_IMPL(commpress, CPU, m) {
  m.impl("pack_bits", &pack_bits_cpu);
  m.impl("unpack_bits", &unpack_bits_cpu);
}

}  // namespace commpress
