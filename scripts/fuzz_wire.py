"""Coverage-guided fuzzing of ``commpress.wire.from_bytes`` + decode, every codec and dtype (#12).

The target parses arbitrary bytes as one packet (raw mode, first input byte even) or builds a
real packet of a codec x dtype chosen by the input and overwrites a few of its bytes with
extreme floats or raw bytes (structured mode, odd); a packet that passes validation is decoded
by its codec and must be finite in its dtype. The only exception allowed is ``WireError``; any
other exception, a non-finite decode, an RSS above ``--rss-mb`` or an input slower than
``--timeout`` seconds is a finding (libFuzzer writes the input under ``--artifacts``).

    # CI budget (tests/test_fuzz.py runs this for ~10 s)
    python scripts/fuzz_wire.py --seconds 10
    # the long run of issue #12 (1,000,000 inputs), growing the kept corpus
    python scripts/fuzz_wire.py --runs 1000000 --keep
    # rewrite the seed corpus (one valid packet per codec x dtype x size)
    python scripts/fuzz_wire.py --make-corpus

Needs ``atheris`` (requirements/dev.txt). The options, corpus handling (``--keep`` grows
``tests/fuzz_corpus/wire``, else it is only read), timing and reports are the shared harness's
(``scripts/fuzz_common.py``): libFuzzer's status lines and final stats give the inputs run,
inputs/s (``exec/s``), coverage (``cov``: instrumented edges of commpress reached; ``ft``:
features) and peak RSS; the harness adds the slowest input and keeps inputs over ``--slow-ms``.
"""

from __future__ import annotations

import os
import struct
import sys

import fuzz_common

#: decoded size bound while fuzzing (with max(.., 8 per byte) and 4 KiB inputs: <= 64k elements)
FUZZ_MAX_NUMEL = 1 << 16
SPECS = ["none", "fp16", "bf16", "topk:ratio=0.25", "randomk:ratio=0.25", "randomk:k=3,scaled=false",
         "sign", "sign:block_size=8", "qsgd", "qsgd:bits=2", "qsgd:bits=8,bucket_size=16",
         "qsgd:coding=gamma", "qsgd:bits=8,coding=gamma,bucket_size=16"]
DTYPES = ["float32", "float16", "bfloat16", "float64"]


def make_corpus(directory: str) -> int:
    """Write one valid packet per codec spec x dtype x size into ``directory``; return the count."""
    import torch

    from commpress import codecs, wire
    from commpress.wire.packet import FLOAT_DTYPE_CODES

    os.makedirs(directory, exist_ok=True)
    count = 0
    g = torch.Generator().manual_seed(12)
    for spec in SPECS:
        codec = codecs.from_spec(spec)
        for dtype in FLOAT_DTYPE_CODES:
            for n in (0, 1, 9, 33):
                if n == 0 and spec.startswith(("topk:k", "randomk:k")):
                    continue
                if n and spec.startswith("randomk:k=3") and n < 3:
                    continue
                x = (torch.randn(n, generator=g) * 10).to(dtype)
                data = wire.to_bytes(codec.encode(x, seed=n)).numpy().tobytes()
                name = f"{spec.replace(':', '_').replace(',', '_').replace('=', '')}-{str(dtype)[6:]}-{n}"
                with open(os.path.join(directory, name), "wb") as f:
                    f.write(b"\0" + data)  # mode byte: raw packet
                count += 1
    for i in range(8):  # structured mode: a choice of codec x dtype, then patches
        with open(os.path.join(directory, f"structured-{i}"), "wb") as f:
            f.write(bytes([1, i, i * 37 % 256, 200, 3, 1, 255, 255, 0, 0, 128, 127]) * 4)
        count += 1
    return count


class Target:
    """The fuzz target: ``from_bytes`` then decode; counts the packets that pass validation."""

    def __init__(self) -> None:
        import torch

        from commpress import codecs, wire
        from commpress.errors import CodecError, WireError

        self.torch, self.codecs, self.wire = torch, codecs, wire
        self.WireError, self.CodecError = WireError, CodecError
        self.accepted = 0

    def codec_for(self, packet):  # noqa: ANN001, ANN201 - the decoder of a validated packet
        """A codec instance able to decode ``packet`` (decode reads its parameters from the packet)."""
        extra = {}
        if packet.codec in ("topk", "randomk"):
            extra = {"k": max(packet.params[0], 1)}
        return self.codecs.get(packet.codec, **extra)

    def packet_from(self, data: bytes) -> bytes:
        """Structured mode: a valid packet of a codec x dtype chosen by ``data``, then patched.

        Raw mutation rarely gets past the header; this mode starts from a real packet and
        overwrites a few of its bytes with extreme floats (Inf, NaN, huge, subnormal) or raw
        bytes, which is how scales and values beyond the output dtype are reached.
        """
        import atheris

        torch = self.torch
        fdp = atheris.FuzzedDataProvider(data)
        codec = self.codecs.from_spec(SPECS[fdp.ConsumeIntInRange(0, len(SPECS) - 1)])
        dtype = getattr(torch, DTYPES[fdp.ConsumeIntInRange(0, len(DTYPES) - 1)])
        n = fdp.ConsumeIntInRange(0, 64)
        x = torch.tensor([fdp.ConsumeFloatInRange(-1e4, 1e4) for _ in range(n)], dtype=torch.float64).to(dtype)
        try:
            buf = bytearray(self.wire.to_bytes(codec.encode(x, seed=fdp.ConsumeIntInRange(0, 7))).numpy().tobytes())
        except self.CodecError:  # k larger than n and the like: the encoder refuses, fine
            return b""
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            width = (2, 4, 8)[fdp.ConsumeIntInRange(0, 2)]
            off = fdp.ConsumeIntInRange(0, max(0, len(buf) - width))
            if fdp.ConsumeBool():
                fmt = {2: "<e", 4: "<f", 8: "<d"}[width]
                value = fdp.ConsumeFloat()
                try:
                    patch = struct.pack(fmt, value)
                except (OverflowError, struct.error):
                    patch = struct.pack(fmt, float("inf") if value > 0 else float("-inf"))
            else:
                patch = fdp.ConsumeBytes(width)
            buf[off : off + len(patch)] = patch
        return bytes(buf)

    def __call__(self, data: bytes) -> None:
        """Parse ``data`` (raw mode: first byte even) or a patched real packet (odd); check the decode."""
        if not data:
            return
        buf = data[1:] if data[0] % 2 == 0 else self.packet_from(data[1:])
        try:
            packet = self.wire.from_bytes(buf, max_numel=FUZZ_MAX_NUMEL)
        except self.WireError:
            return
        self.accepted += 1
        out = self.codec_for(packet).decode(packet)
        if out.numel() != packet.numel or not bool(self.torch.isfinite(out).all()):
            raise AssertionError(f"validated {packet.codec} {packet.dtype} packet decodes to non-finite values")


def main() -> int:
    """Fuzz ``from_bytes`` + decode with the shared harness (:mod:`fuzz_common`)."""
    return fuzz_common.main("wire", __doc__ or "", Target, make_corpus, max_len=4096)


if __name__ == "__main__":
    sys.exit(main())
