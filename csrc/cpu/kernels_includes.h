// Headers every kernels_<isa>.cpp includes before its target pragma (see kernels_impl.h).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // declares every intrinsic; usable inside a matching target region
#endif

#include "commpress/bitpack.h"
#include "commpress/codec_cores.h"
#include "commpress/hd.h"
#include "commpress/rng.h"
#include "commpress/tree.h"
#include "kernels.h"
