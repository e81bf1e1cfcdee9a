"""The dtype rules every layer shares (codecs, kernels, error feedback, collectives).

One definition each, so a codec's specification, its kernels and the collectives that sum its
output can never disagree about which dtype an index, a scale or a running sum has.
"""

from __future__ import annotations

import torch

#: Floating-point dtypes commpress encodes.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: Largest element count whose indices fit int32.
INT32_MAX = (1 << 31) - 1


def index_dtype(numel: int) -> torch.dtype:
    """Dtype of index sections: int32 while every index fits, else int64."""
    return torch.int32 if numel <= INT32_MAX else torch.int64


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of arithmetic and sums for ``dtype`` input: float64 for float64, float32 otherwise.

    Used for codec math (scales, norms), error-feedback residuals and decoded sums alike, so
    half-precision gradients are never summed or corrected in half precision.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32
