"""``state.dcp()``: an :class:`FSDPCompressionState` in ``torch.distributed.checkpoint`` (DCP).

Usage (every rank, with the model's and optimizer's own entries)::

    dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "commpress": state.dcp()}, checkpoint_id=d)
    dcp.load({"model": model.state_dict(), "optim": opt.state_dict(), "commpress": state.dcp(checkpoint_id=d)},
             checkpoint_id=d)   # a bare state.dcp() loads only at the world size it was saved at

**Why an adapter, not the state itself.** DCP treats a plain tensor (or value) under the same
key on several ranks as *replicated*: its default save planner keeps one copy
(``_dedup_save_plans``: the rank with the smallest plan writes it) and every rank reads that copy
back. The per-rank :meth:`FSDPCompressionState.state_dict` (one file per rank; kept as it is)
has the same keys on every rank with different values (``rank``, residuals, velocities): in DCP
every rank but one would load another rank's entries. :meth:`DCPState.state_dict` namespaces
everything under ``rank{r}_of_{n}``, so no key is shared, nothing is deduplicated and each rank
reads exactly what it wrote.

**DCP loads tensors in place**: before the read, each rank's :meth:`DCPState.state_dict` must
hold every key with its saved shape. So the form has one layout per configuration, whatever
the training has reached: every residual and velocity this rank *can* keep (zeros where it
keeps none yet) with a ``*_present`` mask, the call counts (and, with ``codec="auto"``, the choices) as one int64 tensor each (module order),
and the header (format, codec, options, rank, world size, seed, step, guard) as JSON in a
fixed :data:`HEADER_NBYTES` uint8 tensor, so another configuration's header still loads and
:meth:`FSDPCompressionState.load_state_dict` can say what differs. Everything is a tensor:
DCP's file reader loads each tensor with ``torch.load(weights_only=True)``; nothing of commpress's goes
through the pickle DCP uses for non-tensor values (``torch.load(weights_only=False)`` in its
default planner; its ``.metadata`` file is a pickle whatever the values are).

**Another world size.** DCP calls a ``Stateful``'s ``state_dict()`` before it reads the
checkpoint's metadata and never tells it which checkpoint it loads, and the entries are
namespaced ``rank{r}_of_{n}``: a bare ``state.dcp()`` at another world size asks for keys the
checkpoint lacks, and DCP's planner raises ``Missing key in checkpoint state_dict:
commpress.rank0_of_4.header`` on every rank (a collective error, before anything is read: no
hang). So the load names the checkpoint, as ``dcp.load`` itself takes it::

    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "commpress": state.dcp(checkpoint_id=d)}
    dcp.load(sd, checkpoint_id=d)      # any world size; also storage_reader=

:class:`DCPState` then reads the checkpoint's metadata (``StorageReader.read_metadata()``, the
file ``dcp.load`` reads too): at the same world size nothing changes; at another one, the saved
world size is in the headers' names, and this rank's ``state_dict()`` is the layout (the
metadata's shapes and dtypes) of the entry it reads, its own rank's or, for a rank the old run
did not have, rank 0's. That entry is decoded into the per-rank file form of its rank and goes
through :meth:`FSDPCompressionState.load_state_dict`, which keeps what is the same on every
rank (configuration, step, seed, call counts, guard state, ``codec="auto"``'s choices) and
drops the residuals and velocities with one warning naming their count and norm, exactly as
a file of another world size. Why this and not a world-size-independent entry saved next to
the per-rank ones: the format is unchanged, so checkpoints written before this change resize
too; one loader and one warning serve files and DCP; and the warning can name what it drops
(a global entry holds no per-rank norms). The cost: the old rank's residuals are read once
to be counted, no more than a load at the same world size reads.

**Mismatches.** Another codec, options, seed or model with the same layout load, then
:meth:`FSDPCompressionState.load_state_dict` raises its ``... mismatch: checkpoint has ...,
this state ...`` error on every rank, the commpress state unchanged (DCP has already read the
other entries, the model's and optimizer's, in place); a different layout (another residual
dtype, error feedback on or off, other parameters) fails in DCP's planner naming the key. The
same world size with another rank's header is refused (``rank mismatch``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, StorageReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import ConfigurationError
from . import residuals as rstore

if TYPE_CHECKING:
    from .state import FSDPCompressionState

#: Bytes of the JSON header tensor (zero-padded; the header holds no per-module or per-parameter data).
HEADER_NBYTES = 4096
DCP_FORMAT = 1
_HEADER_KEYS = ("format", "codec", "error_feedback", "residual_dtype", "world_size", "rank", "seed", "step", "guard",
                "velocity_dtype")
#: A saved entry's header: ``<key>.rank{r}_of_{n}.header`` (``<key>``: the entry's name in the dcp dict).
_HEADER_FQN = re.compile(r"(.+)\.rank(\d+)_of_(\d+)\.header")


def _encode_header(header: Mapping[str, Any]) -> torch.Tensor:
    raw = json.dumps(header, sort_keys=True).encode()  # a non-finite guard ratio is refused on load, as in a file
    if len(raw) > HEADER_NBYTES:
        raise ConfigurationError(f"commpress DCP header is {len(raw)} bytes, more than {HEADER_NBYTES}: {raw[:80]!r}...")
    out = torch.zeros(HEADER_NBYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def _decode_header(t: Any) -> dict[str, Any]:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != (HEADER_NBYTES,):
        raise ValueError(f"commpress DCP header must be a uint8 tensor of {HEADER_NBYTES} bytes")
    raw = bytes(t.numpy().tobytes()).rstrip(b"\0")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"commpress DCP header is not valid JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("dcp_format") != DCP_FORMAT:
        raise ValueError(f"commpress DCP header has format {header.get('dcp_format') if isinstance(header, dict) else header!r}, "
                         f"expected {DCP_FORMAT}")
    return header


class DCPState:
    """The DCP view of one rank's :class:`FSDPCompressionState` (a ``Stateful``; see the module docstring).

    Built by :meth:`FSDPCompressionState.dcp`; holds no state of its own, so one made before
    ``dcp.load`` restores the state it came from. Given the checkpoint a load reads
    (``checkpoint_id`` or ``storage_reader``, as ``dcp.load`` takes them), it reads that
    checkpoint's metadata: at another world size its :meth:`state_dict` is then the layout of the
    saved entry this rank reads (its own rank's, or rank 0's for a rank the old run did not have);
    ``key`` (the entry's name in the ``dcp.load`` dict) is needed only when the checkpoint holds
    several commpress states. Pass those to ``dcp.load`` only: ``dcp.save`` writes whatever
    :meth:`state_dict` returns.
    """

    __slots__ = ("state", "saved")

    def __init__(self, state: FSDPCompressionState, checkpoint_id: str | os.PathLike[str] | None = None, *,
                 storage_reader: StorageReader | None = None, key: str | None = None) -> None:
        self.state = state
        #: another world size's entry that a load reads: ``(rank, world size, {name: (shape, dtype)})``; None: this one's
        self.saved: tuple[int, int, dict[str, tuple[tuple[int, ...], torch.dtype]]] | None = None
        if storage_reader is None and checkpoint_id is not None:
            storage_reader = FileSystemReader(checkpoint_id)
        if storage_reader is not None:
            where = str(checkpoint_id) if checkpoint_id is not None else type(storage_reader).__name__
            self.saved = _saved_entry(storage_reader.read_metadata(), state.rank, state.world_size, key, where)

    @property
    def key(self) -> str:
        """The namespace of this rank's entries: ``rank{r}_of_{n}`` (the saved entry's at another world size)."""
        if self.saved is not None:
            return f"rank{self.saved[0]}_of_{self.saved[1]}"
        return f"rank{self.state.rank}_of_{self.state.world_size}"

    def _layout(self) -> tuple[_Layout, dict[str, int], _Layout]:
        """What this rank can keep: residual tensors, float32 velocity numels, quantised velocity tensors."""
        s = self.state
        floats, stored = s._velocity_layout()
        return (_quantized_layout(s.residual_kind, {k: n for k, (n,) in s.residual_shapes().items()}, rstore.BLOCK),
                dict(sorted(floats.items())), _quantized_layout(s.velocity_kind, stored, rstore.VELOCITY_BLOCK))

    def state_dict(self) -> dict[str, Any]:
        """The rank's state under ``rank{r}_of_{n}``: tensors only, one fixed layout per configuration.

        With another world size's checkpoint to read: zeros in that entry's layout, for ``dcp.load`` to fill.
        """
        if self.saved is not None:
            out: dict[str, Any] = {}
            for name, (shape, dtype) in self.saved[2].items():
                top, dot, sub = name.partition(".")  # our top-level names hold no dot; residual keys may
                if dot:
                    out.setdefault(top, {})[sub] = torch.zeros(shape, dtype=dtype)
                else:
                    out[top] = torch.zeros(shape, dtype=dtype)
            return {self.key: out}
        plain = self.state.state_dict()
        residual_layout, velocity_layout, stored_layout = self._layout()
        saved_residuals = dict(plain["residuals"])
        saved_velocity = dict(plain["velocity"])
        saved_codes = dict(plain.get("velocity_codes") or {})
        unknown = ((set(saved_residuals) - set(residual_layout)) | (set(saved_velocity) - set(velocity_layout))
                   | (set(saved_codes) - set(stored_layout)))
        if unknown:  # cannot happen for a state this module knows; refuse rather than drop it silently
            raise ConfigurationError(f"commpress DCP: state holds {sorted(unknown)} outside its layout")
        header = {k: plain[k] for k in _HEADER_KEYS}
        header["dcp_format"] = DCP_FORMAT
        out = {
            "header": _encode_header(header),
            "calls": torch.tensor([plain["calls"][m.name] for m in self.state.modules], dtype=torch.int64),
        }
        _put_quantized(out, "residuals", "residual_scales", "residual_present", residual_layout,
                       saved_residuals, dict(plain.get("residual_scales") or {}))
        _put_quantized(out, "velocity_codes", "velocity_scales", "velocity_codes_present", stored_layout,
                       saved_codes, dict(plain.get("velocity_scales") or {}))
        if velocity_layout:
            out["velocity"] = {k: _stored(saved_velocity.get(k), (n,), torch.float32) for k, n in velocity_layout.items()}
            out["velocity_present"] = torch.tensor([k in saved_velocity for k in velocity_layout], dtype=torch.uint8)
        if "auto" in plain:  # codec="auto": one int64 per module (commpress.fsdp.auto.FSDPAuto.state)
            out["auto"] = torch.tensor(plain["auto"], dtype=torch.int64)
        return {self.key: out}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (after DCP's read): validated by ``FSDPCompressionState.load_state_dict``.

        Another world size's entry is read in its own layout (sorted keys, as it was written) and
        handed over as that rank's file form: the state's loader keeps what is global and drops the
        rest with its one warning.
        """
        if set(state_dict) != {self.key}:
            raise ValueError(f"commpress DCP state holds {sorted(state_dict)}, this rank reads {self.key!r} "
                             "(at another world size, pass state.dcp(checkpoint_id=...) to dcp.load)")
        mine = state_dict[self.key]
        if not isinstance(mine, Mapping):
            raise ValueError(f"commpress DCP state {self.key!r} must be a mapping, got {type(mine).__name__}")
        header = _decode_header(mine.get("header"))
        calls = mine.get("calls")
        if not isinstance(calls, torch.Tensor) or calls.dtype != torch.int64 or calls.shape != (len(self.state.modules),):
            raise ValueError(f"commpress DCP calls must be an int64 tensor of {len(self.state.modules)} modules")
        residual_layout: Collection[str]
        velocity_layout: Collection[str]
        stored_layout: Collection[str]
        if self.saved is None:
            residual_layout, velocity_layout, stored_layout = self._layout()
            residual_scales = self.state.residual_kind in rstore.QUANTIZED
            velocity_scales = self.state.velocity_kind in rstore.QUANTIZED
        else:  # another world size: the entry's own layout, in the sorted order it was written in
            residual_layout, velocity_layout, stored_layout = (_saved_keys(mine, n) for n in ("residuals", "velocity",
                                                                                               "velocity_codes"))
            residual_scales, velocity_scales = "residual_scales" in mine, "velocity_scales" in mine
        plain: dict[str, Any] = {k: header[k] for k in _HEADER_KEYS if k in header}
        plain["calls"] = {m.name: int(c) for m, c in zip(self.state.modules, calls.tolist())}
        plain["residuals"] = _present(mine, "residuals", residual_layout, "residual_present")
        if residual_scales:
            plain["residual_scales"] = _present(mine, "residual_scales", residual_layout, "residual_present")
        plain["velocity"] = _present(mine, "velocity", velocity_layout, "velocity_present")
        if stored_layout:
            plain["velocity_codes"] = _present(mine, "velocity_codes", stored_layout, "velocity_codes_present")
            if velocity_scales:
                plain["velocity_scales"] = _present(mine, "velocity_scales", stored_layout, "velocity_codes_present")
        if "auto" in mine:
            auto = mine["auto"]
            if not isinstance(auto, torch.Tensor) or auto.dtype != torch.int64 or auto.shape != (len(self.state.modules),):
                raise ValueError(f"commpress DCP auto must be an int64 tensor of {len(self.state.modules)} modules")
            plain["auto"] = [int(c) for c in auto.tolist()]
        self.state._load_state_dict(plain, "DCP entry")

    def __repr__(self) -> str:
        return f"DCPState({self.key!r}, {self.state!r})"


def _saved_entry(metadata: Metadata, rank: int, world_size: int, key: str | None,
                 where: str) -> tuple[int, int, dict[str, tuple[tuple[int, ...], torch.dtype]]] | None:
    """The entry a load at another world size reads, from the checkpoint's metadata (None: saved at this one).

    The saved world size is in the names of the headers (``<key>.rank{r}_of_{n}.header``); a rank
    the old run did not have reads rank 0's entry. Its layout is the metadata's shapes and dtypes.
    """
    found: dict[str, set[int]] = {}
    for fqn in metadata.state_dict_metadata:
        m = _HEADER_FQN.fullmatch(fqn)
        if m is not None and (key is None or m.group(1) == key):
            found.setdefault(m.group(1), set()).add(int(m.group(3)))
    if not found:
        raise ValueError(f"commpress DCP: checkpoint {where} holds no commpress state"
                         f"{f' under {key!r}' if key is not None else ''} (no <key>.rank<r>_of_<n>.header entry): "
                         "it was saved without state.dcp()")
    worlds = set().union(*found.values())
    if worlds == {world_size}:
        return None
    if len(found) > 1:
        raise ValueError(f"commpress DCP: checkpoint {where} holds several commpress states ({sorted(found)}): pass "
                         "state.dcp(checkpoint_id=..., key=<its name in the dcp.load dict>)")
    (prefix, saved_worlds), = found.items()
    if len(saved_worlds) != 1:
        raise ValueError(f"commpress DCP: checkpoint {where} holds {prefix!r} entries of several world sizes "
                         f"{sorted(saved_worlds)}")
    saved_world = saved_worlds.pop()
    saved_rank = rank if rank < saved_world else 0
    head = f"{prefix}.rank{saved_rank}_of_{saved_world}."
    layout = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if fqn.startswith(head):
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"commpress DCP: {fqn} in checkpoint {where} is not a tensor")
            layout[fqn[len(head):]] = (tuple(md.size), md.properties.dtype)
    if "header" not in layout:
        raise ValueError(f"commpress DCP: checkpoint {where} holds no {head}header (rank {saved_rank}'s entry)")
    return saved_rank, saved_world, layout


_Layout = dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]


def _quantized_layout(kind: str, numels: Mapping[str, int], block: int) -> _Layout:
    """Key -> ``{"codes": (shape, dtype)[, "scales": ...]}`` of entries stored as ``kind`` (:mod:`.residuals`)."""
    out: _Layout = {}
    for key, numel in sorted(numels.items()):
        shapes = rstore.stored_shapes(kind, numel, block)
        out[key] = {"codes": (shapes["codes"], rstore.CODE_DTYPES[kind])}
        if "scales" in shapes:
            out[key]["scales"] = (shapes["scales"], torch.float32)
    return out


def _put_quantized(out: dict[str, Any], codes: str, scales: str, present: str, layout: _Layout,
                   saved: Mapping[str, torch.Tensor], saved_scales: Mapping[str, torch.Tensor]) -> None:
    """Write one quantized store (residuals or velocities) in its fixed layout, zeros and a 0 flag where absent."""
    if not layout:
        return
    out[codes] = {}
    if any("scales" in v for v in layout.values()):
        out[scales] = {}
    for key, parts in layout.items():
        shape, dtype = parts["codes"]
        out[codes][key] = _stored(saved.get(key), shape, dtype)
        if "scales" in parts:
            shape, dtype = parts["scales"]
            out[scales][key] = _stored(saved_scales.get(key), shape, dtype)
    out[present] = torch.tensor([k in saved for k in layout], dtype=torch.uint8)


def _stored(value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``value`` (already a copy: ``state_dict()`` clones), or zeros of the layout's shape where absent."""
    if value is None:
        return torch.zeros(shape, dtype=dtype)
    if tuple(value.shape) != shape or value.dtype != dtype:
        raise ConfigurationError(f"commpress DCP: a tensor of {tuple(value.shape)} {value.dtype}, layout {shape} {dtype}")
    return value.detach().contiguous()


def _saved_keys(mine: Mapping[str, Any], name: str) -> list[str]:
    """The keys of ``mine[name]`` in the sorted order an entry is written in (none when absent)."""
    values = mine.get(name, {})
    if not isinstance(values, Mapping):
        raise ValueError(f"commpress DCP {name} must be a mapping")
    return sorted(values)


def _present(mine: Mapping[str, Any], name: str, layout: Collection[str], mask: str) -> dict[str, Any]:
    """The entries of ``mine[name]`` that the ``mine[mask]`` flags mark (the layout's order)."""
    if not layout:
        return {}
    flags = mine.get(mask)
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.uint8 or flags.shape != (len(layout),):
        raise ValueError(f"commpress DCP {mask} must be a uint8 tensor of {len(layout)} flags")
    values = mine.get(name)
    if not isinstance(values, Mapping):
        raise ValueError(f"commpress DCP {name} must be a mapping")
    return {k: values.get(k) for k, flag in zip(layout, flags.tolist()) if flag}
