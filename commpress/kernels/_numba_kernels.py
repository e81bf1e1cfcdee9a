"""The numba kernels behind :mod:`commpress.kernels.numba_cpu` (imported on first use).

Every function takes numpy arrays already checked by the wrapper (sizes, dtypes): numba does
no bounds checking. Arrays of values are float32 or float64 (the codecs' compute dtypes);
``mode`` says which dtype the reference rounds intermediate values to (0: none, the array's
own; 1: float16; 2: bfloat16).

Rounding notes. A float32 operation is computed here as the float64 operation followed by a
rounding to float32 (an assignment to a float32 array, or ``np.float32``): for +, -, *, / and
sqrt of float32 operands that double rounding gives the correctly rounded float32 result,
because float64 has more than 2*24 + 2 bits (Figueroa, 1995). Float16/bfloat16 results are
rounded from the float32 value, like torch does.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SUM_CHUNK = 32
_HALF_MAX = 65504.0
_BF16_MAX = 3.3895313892515355e38
# tree-sum kinds
_ABS, _SQUARE, _SCALED_SQUARE = 0, 1, 2
# status codes (see numba_cpu)
_OK, _NON_FINITE, _OVERFLOW, _ABOVE_LIMIT = 0, 1, 2, 3


@njit(cache=True)
def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(cache=True)
def _draw(key, i):
    """r_i of commpress.rng: mix64(key + (i + 1) * golden), all uint64."""
    return _mix64(key + np.uint64(i + 1) * _GOLDEN)


@njit(cache=True)
def _round(v, mode):
    """``v`` (a float64 holding a float32 value) rounded to float16 / bfloat16, nearest even."""
    if mode == 0:
        return v
    a = abs(v)
    if a == 0.0 or not np.isfinite(a):
        return v
    if mode == 1:
        if a < 2.0**-14:
            q = 2.0**-24  # float16 subnormals
        else:
            q = math.ldexp(1.0, math.frexp(a)[1] - 11)
        r = np.rint(v / q) * q  # exact: q is a power of two
        if abs(r) > _HALF_MAX:
            return math.copysign(np.inf, v)
        return r
    if a < 2.0**-126:
        q = 2.0**-133  # bfloat16 subnormals
    else:
        q = math.ldexp(1.0, math.frexp(a)[1] - 8)
    r = np.rint(v / q) * q
    if abs(r) > _BF16_MAX:
        return math.copysign(np.inf, v)
    return r


@njit(cache=True)
def _add(a, b, mode):
    """``a + b`` the way torch adds two tensors of the rounded dtype (float64 when mode 0)."""
    s = np.float64(a) + np.float64(b)
    if mode == 0:
        return s  # the caller's assignment rounds it to the array's dtype
    return _round(np.float64(np.float32(s)), mode)


@njit(cache=True)
def _w(x, e, i, has_e, mode):
    """The value encoded at i: x[i], or x[i] + e[i] rounded like the reference (x's dtype)."""
    if has_e:
        c = x[i] + e[i]
        if mode == 0:
            return c
        return x.dtype.type(_round(np.float64(c), mode))
    return x[i]


@njit(cache=True)
def _tree_sum(x, e, has_e, mode, start, stop, kind, scale, buf, chunks):
    """commpress.spec.numerics.tree_sum of |w|, w^2 or (w/scale)^2 over w[start:stop] in float64.

    Returns (sum, all finite); w is recomputed from x and e (no copy of it is stored).
    """
    finite = True
    length = stop - start
    nchunks = max(1, (length + _SUM_CHUNK - 1) // _SUM_CHUNK)
    for c in range(nchunks):
        base = start + c * _SUM_CHUNK
        for j in range(_SUM_CHUNK):
            v = 0.0
            if base + j < stop:
                d = np.float64(_w(x, e, base + j, has_e, mode))
                finite &= np.isfinite(d)
                if kind == _ABS:
                    v = abs(d)
                elif kind == _SQUARE:
                    v = d * d
                else:
                    t = d / scale
                    v = t * t
            buf[j] = v
        h = _SUM_CHUNK // 2
        while h >= 1:
            for j in range(h):
                buf[j] = buf[j] + buf[j + h]
            h //= 2
        chunks[c] = buf[0]
    count = nchunks
    while count > 1:
        half = (count + 1) // 2
        for j in range(half):
            b = chunks[2 * j + 1] if 2 * j + 1 < count else 0.0
            chunks[j] = chunks[2 * j] + b
        count = half
    return chunks[0], finite


@njit(cache=True)
def _sum_scratch(block):
    """The buffers _tree_sum needs for blocks of up to ``block`` elements: (chunk, chunk sums)."""
    return np.empty(_SUM_CHUNK), np.empty(max(1, (block + _SUM_CHUNK - 1) // _SUM_CHUNK))


@njit(cache=True)
def _block_range(b, block, n):
    """[start, end) of block b of n elements in blocks of ``block``."""
    start = b * block
    return start, min(n, start + block)


# ----- bit packing -------------------------------------------------------------------------------
@njit(cache=True)
def pack(fields, bits, packed):
    """Pack LSB-first; returns the index of the first field that does not fit, or -1."""
    n = fields.size
    limit = 1 << bits
    for i in range(n):
        if fields[i] >= limit:
            return i
    per = 8 // bits
    for j in range(packed.size):
        acc = 0
        for t in range(per):
            i = j * per + t
            if i < n:
                acc |= np.int64(fields[i]) << (t * bits)
        packed[j] = acc
    return -1


@njit(cache=True)
def unpack(packed, bits, n, fields):
    """Unpack n fields."""
    mask = (1 << bits) - 1
    for i in range(n):
        pos = i * bits
        fields[i] = (np.int64(packed[pos >> 3]) >> (pos & 7)) & mask


# ----- sign --------------------------------------------------------------------------------------
@njit(cache=True)
def sign_encode(x, e, has_e, mode, block, scales, bits):
    """Scales, bits and (with has_e) the new residual; returns a status, writes e only on OK.

    Two passes like the native kernel: block sums, then bits and residual together.
    """
    n = x.size
    buf, chunks = _sum_scratch(block)
    finite = True
    for b in range(scales.size):
        s0, s1 = _block_range(b, block, n)
        total, ok = _tree_sum(x, e, has_e, mode, s0, s1, _ABS, 1.0, buf, chunks)
        finite &= ok
        scales[b] = total / np.float64(s1 - s0)
    if not finite:
        return _NON_FINITE
    for b in range(scales.size):
        if not np.isfinite(scales[b]):
            return _OVERFLOW
    d = np.empty(2, dtype=x.dtype)  # a block's decoded +scale / -scale, compute dtype
    b = -1
    edge = 0
    acc = 0
    for i in range(n):
        if i == edge:
            b += 1
            edge += block
            d[0] = _round(np.float64(scales[b]), mode)
            d[1] = _round(np.float64(-scales[b]), mode)
        w = _w(x, e, i, has_e, mode)
        negative = 1 if w < 0 else 0
        acc |= negative << (i & 7)
        if i & 7 == 7:
            bits[i >> 3] = acc
            acc = 0
        if has_e:
            e[i] = (x[i] + e[i]) - d[negative]
    if n & 7:
        bits[n >> 3] = acc
    return _OK


@njit(cache=True)
def sign_decode(scales, bits, block, out, accumulate, mode):
    """Set out to (out if accumulate else 0) + round(+-scale)."""
    n = out.size
    d = np.empty(2, dtype=out.dtype)
    for b in range(scales.size):
        d[0] = _round(np.float64(scales[b]), mode)
        d[1] = _round(np.float64(-scales[b]), mode)
        for i in range(b * block, min(n, (b + 1) * block)):
            v = d[(bits[i >> 3] >> (i & 7)) & 1]
            if mode == 0:
                out[i] = (out[i] if accumulate else out.dtype.type(0)) + v
            else:
                out[i] = _add(out[i] if accumulate else 0.0, v, mode)


# ----- qsgd --------------------------------------------------------------------------------------
@njit(cache=True)
def _level_values(bits, s, like):
    """(f - s) / s for every field f, in the compute dtype of ``like``."""
    lv = np.empty(1 << bits, dtype=like.dtype)
    for f in range(lv.size):
        lv[f] = (np.float64(f) - np.float64(s)) / np.float64(s)
    return lv


@njit(cache=True)
def qsgd_encode(x, e, has_e, mode, wide, bits, s, bucket, key, limit, norms, packed):
    """Norms, packed levels and (with has_e) the new residual; returns a status. wide: float64."""
    n = x.size
    buf, chunks = _sum_scratch(bucket)
    finite = True
    for b in range(norms.size):
        s0, s1 = _block_range(b, bucket, n)
        if wide:  # divide by the max magnitude first: float64 squares can overflow
            amax = 0.0
            for i in range(s0, s1):
                v = abs(np.float64(_w(x, e, i, has_e, mode)))
                finite &= np.isfinite(v)
                amax = max(amax, v)
            if not finite:
                break
            safe = amax if amax > 0 else 1.0
            total, ok = _tree_sum(x, e, has_e, mode, s0, s1, _SCALED_SQUARE, safe, buf, chunks)
            norms[b] = math.sqrt(total) * amax
        else:
            total, ok = _tree_sum(x, e, has_e, mode, s0, s1, _SQUARE, 1.0, buf, chunks)
            norms[b] = math.sqrt(total)
        finite &= ok
    if not finite:
        return _NON_FINITE
    for b in range(norms.size):
        if not np.isfinite(norms[b]):
            return _OVERFLOW
    for b in range(norms.size):
        if np.float64(norms[b]) > limit:
            return _ABOVE_LIMIT
    lv = _level_values(bits, s, norms)
    dec = np.empty(lv.size, dtype=x.dtype)  # decoded value of each field in the bucket
    top = np.int64(s)
    ft = norms.dtype.type  # the compute float: every product below is rounded to it
    b = -1
    edge = 0
    nb = norms[0]
    p = ft(1.0)
    r = ft(0.0)
    draw = np.uint64(0)
    acc = 0
    for i in range(n):
        if i == edge:
            b += 1
            edge += bucket
            nb = norms[b]
            # fixed-point scale of the bucket (commpress.codecs.qsgd): p exact, r one division
            p = ft(2.0**64) if nb < 2.0**-64 else ft(1.0)
            r = ft(np.float64(ft(s * (2.0**24 - 4.0))) / np.float64(ft(nb * p))) if nb > 0 else ft(0.0)
            if has_e:
                for f in range(dec.size):
                    dec[f] = _round(np.float64(nb * lv[f]), mode)
        w = _w(x, e, i, has_e, mode)
        fixed = np.int64(math.floor(ft(ft(w * p) * r)))  # |fixed| < s * 2**24
        if i == edge - bucket or (i & 1) == 0:
            draw = np.uint64(_draw(key, i >> 1))  # two 24-bit uniforms per draw (rng.paired_u24)
        u24 = np.int64((draw >> np.uint64(32 * (i & 1))) & np.uint64(0xFFFFFF))
        field = ((fixed + u24) >> 24) + top  # floor((T + v) / 2**24) + s
        shift = (i * bits) & 7
        acc |= field << shift
        if shift + bits == 8:
            packed[(i * bits) >> 3] = acc
            acc = 0
        if has_e:
            e[i] = (x[i] + e[i]) - dec[field]
    if (n * bits) & 7:
        packed[(n * bits) >> 3] = acc
    return _OK


@njit(cache=True)
def qsgd_decode(norms, packed, bits, s, bucket, out, accumulate, mode):
    """Set out to (out if accumulate else 0) + round(norm * ((f - s) / s))."""
    lv = _level_values(bits, s, norms)
    dec = np.empty(lv.size, dtype=out.dtype)
    mask = (1 << bits) - 1
    n = out.size
    for b in range(norms.size):
        for f in range(dec.size):
            dec[f] = _round(np.float64(norms[b] * lv[f]), mode)
        for i in range(b * bucket, min(n, (b + 1) * bucket)):
            pos = i * bits
            v = dec[(np.int64(packed[pos >> 3]) >> (pos & 7)) & mask]
            if mode == 0:
                out[i] = (out[i] if accumulate else out.dtype.type(0)) + v
            else:
                out[i] = _add(out[i] if accumulate else 0.0, v, mode)


# ----- top-k -------------------------------------------------------------------------------------
_SAMPLE = 16384  # magnitudes sampled to guess the top-k threshold


@njit(cache=True)
def topk_select(x, k, idx):
    """Indices of the k largest |x|, ties to the lower index, ascending; False on NaN/Inf.

    Large inputs: a threshold from a strided sample keeps about 1.25k candidates in one pass,
    and the exact selection runs on those (all of the k largest and every tie of the k-th are
    among them, since the k-th largest is at least the threshold); when the guess keeps fewer
    than k, every element is a candidate.
    """
    n = x.size
    for i in range(n):
        if not np.isfinite(x[i]):
            return False
    if k == 0:
        return True
    threshold = 0.0
    if n > 4 * _SAMPLE and k < n // 4:
        step = n // _SAMPLE
        sample = np.empty(_SAMPLE)
        for j in range(_SAMPLE):
            sample[j] = abs(np.float64(x[j * step]))
        rank = int(_SAMPLE * (1.0 - 1.25 * k / n))
        threshold = np.partition(sample, rank)[rank]
    cand = np.empty(n, dtype=np.int64)
    count = 0
    for i in range(n):
        if abs(np.float64(x[i])) >= threshold:
            cand[count] = i
            count += 1
    if count < k:  # the sample guessed too high: take everything
        for i in range(n):
            cand[i] = i
        count = n
    mags = np.empty(count)
    for j in range(count):
        mags[j] = abs(np.float64(x[cand[j]]))
    kth = np.partition(mags, count - k)[count - k]
    above = 0
    for j in range(count):
        if mags[j] > kth:
            above += 1
    need_equal = k - above
    out = 0
    for j in range(count):
        m = mags[j]
        if m > kth or (m == kth and need_equal > 0):
            if m == kth:
                need_equal -= 1
            idx[out] = cand[j]
            out += 1
    return True


@njit(cache=True)
def first_bad_index(idx, n):
    """Position of the first index out of [0, n) or not above its predecessor, or -1."""
    for j in range(idx.size):
        v = idx[j]
        if v < 0 or v >= n or (j > 0 and v <= idx[j - 1]):
            return j
    return -1


@njit(cache=True)
def scatter_add(idx, values, out, mode):
    """out[idx[j]] += values[j] (checked, distinct indices)."""
    for j in range(idx.size):
        out[idx[j]] = _add(out[idx[j]], values[j], mode)


# ----- random-k ----------------------------------------------------------------------------------
@njit(cache=True)
def _stratum(j, n, k):
    """(start, length) of stratum j of k over n: edges floor(j * n / k) without overflow."""
    q, r = n // k, n % k
    start = j * q + j * r // k
    stop = (j + 1) * q + (j + 1) * r // k
    return start, stop - start


@njit(cache=True)
def _position(key, j, n, k):
    start, length = _stratum(j, n, k)
    hi = _draw(key, j) >> np.uint64(32)
    return start + np.int64((hi * np.uint64(length)) >> np.uint64(32)), length


@njit(cache=True)
def randomk_gather(x, k, key, scaled, mode, wide, values):
    """One value per stratum (times the stratum length when scaled); returns a status."""
    n = x.size
    for i in range(n):
        if not np.isfinite(x[i]):
            return _NON_FINITE
    for j in range(k):
        where, length = _position(key, j, n, k)
        v = x[where]
        if scaled:
            lt = np.float64(length) if wide else _round(np.float64(np.float32(length)), mode)
            p = np.float64(v) * lt
            if mode != 0:
                p = _round(np.float64(np.float32(p)), mode)
            values[j] = p
            if not np.isfinite(values[j]):
                return _OVERFLOW
        else:
            values[j] = v
    return _OK


@njit(cache=True)
def randomk_scatter_add(values, key, out, mode):
    """out[position_j] += values[j] for the seed's strata."""
    n, k = out.size, values.size
    for j in range(k):
        where, _ = _position(key, j, n, k)
        out[where] = _add(out[where], values[j], mode)
