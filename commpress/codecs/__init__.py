"""Codec registry: ``commpress.codecs.get(name, **params)`` and lookup by wire id.

The ids live in the wire's registry (:mod:`commpress.wire.registry`); every codec class listed
here registers into it when this package is imported.

========  ===========================================  ========  =====================
name      what travels                                 unbiased  contraction delta
========  ===========================================  ========  =====================
none      the tensor                                   yes       1
fp16      fp16 cast                                    no        (rounding only)
bf16      bf16 cast                                    no        (rounding only)
topk      k (index, value) pairs of largest magnitude  no        k/d
randomk   k values at seed-drawn indices               scaled    unscaled: ~k/d
sign      1 bit/element + a scale per block            no        1/block
qsgd      2/4/8-bit stochastic levels + bucket norms   yes       (variance bound)
int8      8-bit levels + a scale per block (absmax)    no        (error <= scale/2 per element)
int4      4-bit levels + a scale per block (absmax)    no        (error <= scale/2 per element)
========  ===========================================  ========  =====================
"""

from __future__ import annotations

import typing
from typing import Any

from ..errors import CodecError
from ..wire import registry as wire_registry
from .base import Codec
from .blockint import Int4Codec, Int8Codec
from .cast import Bf16Codec, Fp16Codec
from .none import NoneCodec
from .qsgd import QSGDCodec
from .randomk import RandomKCodec
from .sign import SignCodec
from .topk import TopKCodec

_CLASSES: tuple[type[Codec], ...] = (
    NoneCodec, Fp16Codec, Bf16Codec, TopKCodec, RandomKCodec, SignCodec, QSGDCodec, Int8Codec, Int4Codec,
)

__all__ = [
    "Bf16Codec", "Codec", "Fp16Codec", "Int4Codec", "Int8Codec", "NoneCodec", "QSGDCodec", "RandomKCodec", "SignCodec",
    "TopKCodec", "available", "register", "codec_class", "codec_class_by_id", "from_config", "from_spec", "get",
    "parse_option", "parse_params", "parse_value", "to_spec",
]


def register(cls: type[Codec]) -> type[Codec]:
    """Add a codec class to the registry (usable as a decorator); its name and wire id must be new.

    A codec is one file: a :class:`Codec` subclass with its reference encode/decode, wire layout,
    properties and capabilities (see ``tests/example_extensions.py`` for a worked example).
    """
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise CodecError(f"register needs a Codec subclass, got {cls!r}")
    wire_registry.register(cls)
    return cls


for _cls in _CLASSES:
    register(_cls)


def available() -> list[str]:
    """Names accepted by :func:`get`, in wire-id order."""
    return wire_registry.names()


def codec_class(name: str) -> type[Codec]:
    """The codec class registered under ``name``; :class:`CodecError` if unknown."""
    return typing.cast("type[Codec]", wire_registry.by_name(name))  # only Codec subclasses register


def codec_class_by_id(codec_id: int) -> type[Codec] | None:
    """The codec class with wire id ``codec_id``, or None."""
    return typing.cast("type[Codec] | None", wire_registry.by_id(codec_id))


def get(name: str, **params: Any) -> Codec:
    """Build a codec: ``get("topk", ratio=0.01)``, ``get("qsgd", bits=4)``, ``get("sign")``."""
    cls = codec_class(name)
    try:
        return cls(**params)
    except TypeError as exc:  # unknown keyword: name it rather than show a Python traceback
        raise CodecError(f"codec {name!r}: {exc}") from None


def from_config(config: dict[str, Any]) -> Codec:
    """Rebuild a codec from :meth:`Codec.config` output (as stored in checkpoints)."""
    if not isinstance(config, dict) or "name" not in config:
        raise CodecError(f"codec config must be a dict with a 'name', got {config!r}")
    params = {k: v for k, v in config.items() if k != "name"}
    return get(config["name"], **params)


def parse_value(text: str) -> Any:
    """One option value: ``true``/``false`` -> bool, ``none`` -> None, then int, float, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_option(item: str, what: str = "spec") -> tuple[str, Any]:
    """One ``key=value`` option (value as :func:`parse_value` reads it); :class:`CodecError` naming ``what``."""
    key, eq, val = item.partition("=")
    if not eq or not key.strip():
        raise CodecError(f"{what}: expected key=value, got {item!r}")
    return key.strip(), parse_value(val.strip())


def parse_params(text: str, what: str = "spec") -> dict[str, Any]:
    """Parse ``key=value,...`` into a dict; values become bool, None, int or float when they read so.

    The package's one option syntax: codec specs (``topk:ratio=0.01``), demo methods, the CLI's
    ``--param`` and the parameter server's fault specs all read options with it.
    """
    return dict(parse_option(item, what) for item in filter(None, (s.strip() for s in text.split(","))))


def from_spec(spec: str) -> Codec:
    """Build a codec from ``name[:key=value,...]``, e.g. ``topk:ratio=0.01`` or ``qsgd:bits=8``."""
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(f"codec spec must be a non-empty string, got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    params = parse_params(rest, f"codec spec {spec!r}")
    try:
        return get(name, **params)
    except CodecError as exc:
        raise CodecError(f"codec spec {spec!r}: {exc}") from None


def to_spec(codec: Codec) -> str:
    """Inverse of :func:`from_spec`: ``TopKCodec(ratio=0.01)`` -> ``"topk:ratio=0.01"``."""
    cfg = {k: v for k, v in codec.config().items() if k != "name" and v is not None}
    return codec.name + (":" + ",".join(f"{k}={v}" for k, v in cfg.items()) if cfg else "")
