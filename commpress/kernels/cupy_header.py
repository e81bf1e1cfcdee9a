"""The C-header evaluator of the CuPy backend: ``csrc/cuda/launch_params.h`` read at run time.

Owns where the CUDA sources are (:data:`CSRC`, :data:`UNITS`) and what ``launch_params.h``
says, evaluated from its very text (:func:`launch_params`): threads, grid caps, reduction
kinds, flag bits, the top-k scratch layout, the template domains the launchers dispatch over
(storage types, pack and QSGD widths), every grid and scratch size as a ``constexpr``
function (``grid_items``, ``grid_words``, ``grid_count``, ``reduce_scratch``,
``encode_scratch``, ...) and the table of NVRTC name expressions (:func:`kernel_names`).
The C launchers include the same header and call the same functions; this module evaluates
them as a small checked subset of C integer arithmetic, and the header's ``static_assert``
values pin both evaluations. A change of geometry is one edit in ``launch_params.h``.

Needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import ast
import itertools
import re
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

#: The CUDA sources the backend compiles at run time: csrc/ of the checkout (source and editable
#: installs), else the copy setup.py puts into the package (wheels and ``pip install .``).
_CHECKOUT_CSRC = Path(__file__).resolve().parents[2] / "csrc"
CSRC = _CHECKOUT_CSRC if (_CHECKOUT_CSRC / "cuda").is_dir() else Path(__file__).resolve().parents[1] / "_csrc"
UNITS = ("bitpack", "sign", "qsgd", "topk", "randomk")


_CONSTEXPR = re.compile(r"constexpr\s+[\w:]+\s+(k\w+)\s*=\s*([^;{]+);")
_INT_LIST = re.compile(r"constexpr\s+int\s+(k\w+)\[\]\s*=\s*\{([^}]*)\};")
_FUNCTION = re.compile(
    r"COMMPRESS_LAUNCH_FN\s+constexpr\s+int64_t\s+(\w+)\(([^)]*)\)\s*\{\s*return\s+([^;]+);\s*\}", re.S
)
_TYPE_LIST = re.compile(r"#define\s+(COMMPRESS_\w+)\(X\)\s*((?:\\\n|[^\n])*)")
_ENUM = re.compile(r"enum\s+\w+\s*:\s*int\s*\{([^}]*)\}")
_TABLE = re.compile(r"constexpr\s+const\s+char\s*\*\s*(k\w+)\[\]\s*=\s*\{(.*?)\};", re.S)
_ARITH = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.Add,
          ast.Sub, ast.Mult, ast.FloorDiv, ast.LShift, ast.USub)
# in a function body besides: calls of earlier functions and one `cond ? a : b`
_BODY = (*_ARITH, ast.Call, ast.IfExp, ast.Compare, ast.Lt, ast.Gt, ast.LtE, ast.GtE, ast.Eq,
         ast.NotEq)


def _eval_int(expr: str, known: dict[str, int]) -> int:
    """An integer constant expression of the header (literals, earlier constants, + - * / <<)."""
    tree = ast.parse(expr.replace("/", "//"), mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ARITH) or (isinstance(node, ast.Constant) and type(node.value) is not int):
            raise ValueError(f"launch_params.h: unsupported constant expression {expr!r}")
        if isinstance(node, ast.Name) and node.id not in known:
            raise ValueError(f"launch_params.h: {node.id} used before it is defined in {expr!r}")
    return int(eval(compile(tree, "launch_params.h", "eval"), {"__builtins__": {}}, dict(known)))


def _function(name: str, params: str, body: str, scope: dict[str, Any]) -> Any:
    """A ``constexpr int64_t name(int64_t a, ...) { return body; }`` of the header, in Python.

    The body is C integer arithmetic on non-negative values (``/`` truncates: ``//`` here) with
    at most one top-level ``cond ? a : b``; names are the parameters, earlier constants and
    functions, and ``name`` itself (recursion).
    """
    args = [p.split()[-1] for p in params.split(",") if p.strip()]
    if any(p.split()[0] != "int64_t" for p in params.split(",") if p.strip()):
        raise ValueError(f"launch_params.h: {name} must take int64_t arguments only")
    expr = " ".join(body.split()).replace("/", "//")
    cond, q, rest = expr.partition("?")
    if q:
        then, colon, other = rest.partition(":")
        if not colon or ":" in other or "?" in other:
            raise ValueError(f"launch_params.h: {name}: one top-level `c ? a : b` at most")
        expr = f"({then}) if ({cond}) else ({other})"
    tree = ast.parse(expr, mode="eval")
    known = {*args, *scope, name}
    for node in ast.walk(tree):
        if not isinstance(node, _BODY) or (isinstance(node, ast.Constant) and type(node.value) is not int):
            raise ValueError(f"launch_params.h: unsupported expression in {name}: {body!r}")
        if isinstance(node, ast.Name) and node.id not in known:
            raise ValueError(f"launch_params.h: {node.id} used before it is defined in {name}")
    source = f"lambda {', '.join(args)}: {ast.unparse(tree)}"
    env = {"__builtins__": {}, **scope}
    fn = eval(compile(source, "launch_params.h", "eval"), env)
    env[name] = fn  # recursion
    return fn


@lru_cache(maxsize=1)
def launch_params() -> SimpleNamespace:
    """The constants, functions, domains and kernel table of ``csrc/cuda/launch_params.h``.

    Attributes: every ``constexpr`` integer, integer list and enumerator by its C++ name
    (``kThreads``, ``kQsgdWidths``, ``kFlagNonFinite``, ...); every ``constexpr int64_t``
    function by its name (``grid_items``, ``reduce_scratch``, ...) as a Python function of
    ints, evaluating the very text the C launchers compile; and ``kernels``: unit -> NVRTC name
    expressions, the table's ``{X}`` placeholders expanded over ``kNameDomains``. Read once,
    on first use; needs no GPU.
    """
    raw = (CSRC / "cuda" / "launch_params.h").read_text(encoding="utf-8")
    text = re.sub(r"//[^\n]*", "", raw)
    # declarations in source order: a function may use any constant or function above it
    decls = sorted(
        [(m.start(), "const", m) for m in _CONSTEXPR.finditer(text)]
        + [(m.start(), "list", m) for m in _INT_LIST.finditer(text)]
        + [(m.start(), "fn", m) for m in _FUNCTION.finditer(text)]
        + [(m.start(), "enum", m) for m in _ENUM.finditer(text)],
        key=lambda d: d[0],
    )
    values: dict[str, Any] = {}
    for _, kind, m in decls:
        if kind == "const":
            values[m.group(1)] = _eval_int(m.group(2).strip(), values)
        elif kind == "list":
            values[m.group(1)] = tuple(_eval_int(v.strip(), values) for v in m.group(2).split(","))
        elif kind == "fn":
            values[m.group(1)] = _function(m.group(1), m.group(2), m.group(3), values)
        else:
            for item in m.group(1).split(","):
                if item.strip():
                    name, expr = (part.strip() for part in item.split("="))
                    values[name] = _eval_int(expr, values)
    type_lists = {
        name: [args.split(",")[-1].strip() for args in re.findall(r"X\(([^)]*)\)", body)]
        for name, body in _TYPE_LIST.findall(raw)
    }
    tables = {name: re.findall(r'"([^"]*)"', body) for name, body in _TABLE.findall(text)}
    domains: dict[str, list[str]] = {}
    for entry in tables["kNameDomains"]:
        key, _, spec = (part.strip() for part in entry.partition("="))
        if spec in type_lists:
            domains[key] = type_lists[spec]
        elif isinstance(values.get(spec), tuple):
            domains[key] = [str(v) for v in values[spec]]
        else:
            domains[key] = [v.strip() for v in spec.split(",")]
    kernels: dict[str, list[str]] = {}
    for entry in tables["kKernelNames"]:
        unit, _, expr = (part.strip() for part in entry.partition(":"))
        keys = [k for k in domains if "{" + k + "}" in expr]
        for combo in itertools.product(*(domains[k] for k in keys)):
            name = expr
            for key, value in zip(keys, combo):
                name = name.replace("{" + key + "}", value)
            kernels.setdefault(unit, []).append(name)
    return SimpleNamespace(**values, domains=domains, kernels=kernels)


def kernel_names(unit: str) -> list[str]:
    """Every kernel instantiation the launches of ``unit`` use (NVRTC name expressions)."""
    names = launch_params().kernels.get(unit)
    if not names:
        raise ValueError(f"unknown CUDA source unit {unit!r}; expected one of {', '.join(UNITS)}")
    return names
