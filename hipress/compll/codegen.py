"""Assemble the generated Python module of a spec (host code, Numba kernels, CUDA source).

The module is plain text, written to the disk cache (or by ``hipress compll build``) and
imported; it holds everything the codec class needs, so a cache hit never parses the
spec again:

- ``SPEC_NAME``, ``CODEC_NAME``, ``SPEC_FILE``, ``FLAGS``, ``PARAMS``, ``INPUT_DTYPE``: the
  header;
- ``layout(n, P)``: (dtype, count) of each section for n elements (bounds when
  ``variable_size``);
- ``encode(xp, g, P, ctx)`` / ``decode(xp, sections, n, P, ctx)``: the host programs,
  the same text for NumPy and CuPy (``xp``);
- ``_loop<i>``: one wrapper per fused loop, dispatching to the Numba kernel ``_k<i>``
  (CPU) or to CUDA kernel ``k<i>`` of ``CUDA_SOURCE`` (GPU).

Nothing from the spec is pasted into the module as raw text: strings and values (the spec
file's name, its text, parameter defaults, the CUDA source) go in as Python literals
(:func:`py_literal`), and names (codec, parameters) are checked to be ASCII identifiers
(:func:`check_identifier`) before they are used in code.
"""

from __future__ import annotations

import functools
import hashlib
import keyword
import math
import os
import re
from typing import Any, Dict, List

import numpy as np

from hipress.compll import cpu, cuda
from hipress.compll import typesys as T
from hipress.compll.check import SpecInfo
from hipress.compll.errors import CompLLError
from hipress.compll.plan import (
    If,
    Loop,
    LoopCall,
    Planner,
    Program,
    Reduce,
    Store,
    np_dtype,
    plan,
    reduce_identity,
)

#: Bump when generated code changes meaning: it is part of every cache key.
GENERATOR_VERSION = "1"


#: Files whose text decides what the generator emits (their hash is part of cache keys).
_GENERATOR_FILES = ("grammar.lark", "parser.py", "check.py", "typesys.py", "nodes.py",
                    "plan.py", "cpu.py", "cuda.py", "codegen.py", "cpuhelp.py")


@functools.lru_cache(maxsize=1)
def generator_fingerprint() -> str:
    """Return a hash of the generator's own sources, so a changed generator misses the cache."""
    h = hashlib.sha256(GENERATOR_VERSION.encode())
    here = os.path.dirname(__file__)
    for name in _GENERATOR_FILES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def spec_digest(source: str) -> str:
    """Return the cache key of a spec's text (sha256 of the generator and of the text)."""
    key = f"compll-{generator_fingerprint()}\n{source}"
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_identifier(name: str, what: str) -> str:
    """Return ``name`` if it is an ASCII Python identifier that is not a keyword.

    The grammar only produces such names; this guards the generated code against a
    caller that builds a :class:`~hipress.compll.check.SpecInfo` some other way.

    Raises:
        CompLLError: ``name`` is anything else.
    """
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name) or keyword.iskeyword(name):
        raise CompLLError(f"{what} {name!r} is not a valid name (ASCII letters, digits and "
                          "'_', not starting with a digit); rename it in the spec")
    return name


def py_literal(value: Any) -> str:
    """Return Python source that evaluates to ``value``.

    ``value`` is None, a bool, int, float or str, or a list, tuple or string-keyed dict of
    those. Strings go through :func:`repr`, so quotes, backslashes and newlines in them cannot
    end the literal; non-finite floats become ``float('inf')``, ``float('-inf')`` and
    ``float('nan')`` (``repr`` gives bare ``inf``, which is not a Python literal).

    Raises:
        TypeError: a value of another type.
    """
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, (int, np.integer)):
        return repr(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return repr(v) if math.isfinite(v) else f"float({repr(v)!r})"
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"py_literal: dict key {k!r} is not a string")
            items.append(f"{k!r}: {py_literal(v)}")
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(py_literal(v) + ", " for v in value) + ")"
    raise TypeError(f"py_literal: cannot write a {type(value).__name__} as a literal")


def _outputs(loop: Loop) -> List[str]:
    names = []
    for o in loop.outputs:
        if isinstance(o, Store):
            names.append(o.arr.var)
        elif isinstance(o, Reduce):
            names.append(o.out.var)
        else:
            names.append(o.idx.var)
            names += [arr.var for _, arr in o.values]
    return names


def _emit_body(stmts: List[Any], indent: str, out: List[str]) -> None:
    for st in stmts:
        if isinstance(st, str):
            out.append(indent + st)
        elif isinstance(st, LoopCall):
            lp = st.loop
            arrays, scalars, _ = lp.inputs()
            args = ["xp", lp.length] + [a.var for a in arrays] + [s.var for s in scalars] + ["ctx"]
            outs = _outputs(lp)
            out.append(f"{indent}{', '.join(outs)}, = {lp.name}({', '.join(args)})")
        elif isinstance(st, If):
            out.append(f"{indent}if {st.cond}:")
            _emit_body(st.then, indent + "    ", out)
            if not st.then:
                out.append(indent + "    pass")
            out.append(f"{indent}else:")
            _emit_body(st.other, indent + "    ", out)
            if not st.other:
                out.append(indent + "    pass")
        else:  # pragma: no cover
            raise AssertionError(f"unknown host statement {st!r}")


def _param_lines(info: SpecInfo) -> List[str]:
    return [f"    P_{check_identifier(p.name, 'parameter')} = P[{p.name!r}]"
            for p in info.params]


def _np_arg(t: T.Scalar, code: str) -> str:
    if t.is_float:
        return f"np.{np.dtype(t.dtype).name}({code})"
    if t.kind == "bool":
        return f"bool({code})"
    return f"np.int64({code})"


def _store_size(arr_elem: T.Scalar, n: str) -> str:
    if arr_elem.packed:
        return f"({n} * {arr_elem.bits} + 7) // 8"
    return n


def _wrapper(loop: Loop) -> str:
    arrays, scalars, rand = loop.inputs()
    params = ["xp", "n_"] + [f"in{i}" for i in range(len(arrays))] + \
             [f"s{i}" for i in range(len(scalars))] + ["ctx"]
    lines = [f"def {loop.name}({', '.join(params)}):",
             "    n_ = int(n_)"]
    if rand:
        lines.append("    key = ctx.key()")
    # ------------------------------------------------------------------ CPU path
    lines.append("    if xp is np:")
    kargs = ["n_"] + [f"in{i}" for i in range(len(arrays))]
    kargs += [_np_arg(s.ty, f"s{i}") for i, s in enumerate(scalars)]
    if rand:
        kargs.append("np.uint64(key)")
    rets, nret = [], 0
    for j, o in enumerate(loop.outputs):
        if isinstance(o, Store):
            lines.append(f"        out{j} = np.empty({_store_size(o.arr.elem, 'n_')}, "
                         f"{np_dtype(o.arr.elem)})")
            kargs.append(f"out{j}")
            rets.append(f"out{j}")
        elif isinstance(o, Reduce):
            rets.append(_np_arg(o.out.ty, f"res[{nret}]") if o.out.ty.is_float
                        else f"int(res[{nret}])")
            nret += 1
        else:
            lines.append(f"        idx{j} = np.empty(n_, np.int32)")
            kargs.append(f"idx{j}")
            rets.append(f"idx{j}[:res[{nret}]]")
            for q, (_, arr) in enumerate(o.values):
                lines.append(f"        val{j}_{q} = np.empty(n_, {np_dtype(arr.elem)})")
                kargs.append(f"val{j}_{q}")
                rets.append(f"val{j}_{q}[:res[{nret}]]")
            nret += 1
    lines.append(f"        res = _rt.cpu_kernel(__name__, '_k{loop.id}')({', '.join(kargs)})")
    lines.append(f"        return ({''.join(r + ', ' for r in rets)})")
    # ------------------------------------------------------------------ GPU path
    g = cuda.group_size(loop)
    cargs = ["np.int64(n_)"] + [f"in{i}" for i in range(len(arrays))]
    cargs += [f"{cuda.ARG_NP[s.ty.kind]}(s{i})" for i, s in enumerate(scalars)]
    if rand:
        cargs.append("np.uint64(key)")
    lines.append("    mod = _rt.cuda_module(__name__, CUDA_SOURCE)")
    lines.append(f"    grid = _rt.grid((n_ + {g - 1}) // {g})")
    rets, after = [], []
    for j, o in enumerate(loop.outputs):
        if isinstance(o, Store):
            lines.append(f"    out{j} = xp.empty({_store_size(o.arr.elem, 'n_')}, "
                         f"{np_dtype(o.arr.elem)})")
            cargs.append(f"out{j}")
            rets.append(f"out{j}")
        elif isinstance(o, Reduce):
            t = o.out.ty
            dt = np_dtype(t) if t.is_float else "np.int64"
            ident = reduce_identity(o.op, t)
            lines.append(f"    part{j} = xp.full(grid, {py_literal(ident)}, {dt})")
            cargs.append(f"part{j}")
            rets.append(f"_rt.finish(part{j}, {o.op!r}, {np_dtype(t) if t.is_float else 'int'})")
        else:
            lines.append(f"    mask{j} = xp.zeros(n_, np.bool_)")
            cargs.append(f"mask{j}")
            after.append(f"    idx{j} = xp.flatnonzero(mask{j}).astype(np.int32)")
            rets.append(f"idx{j}")
            if o.values:
                vargs = [f"np.int64(idx{j}.size)", f"idx{j}"] + cargs[1:1 + len(arrays) +
                                                                   len(scalars) + rand]
                for q, (_, arr) in enumerate(o.values):
                    after.append(f"    val{j}_{q} = xp.empty(idx{j}.size, {np_dtype(arr.elem)})")
                    vargs.append(f"val{j}_{q}")
                    rets.append(f"val{j}_{q}")
                after.append(f"    if idx{j}.size:")
                after.append(f"        mod.get_function('k{loop.id}_v{j}')("
                             f"(_rt.grid(idx{j}.size),), (_rt.BLOCK,), ({', '.join(vargs)},))")
    lines.append("    if n_ > 0:")
    lines.append(f"        mod.get_function('k{loop.id}')((grid,), (_rt.BLOCK,), "
                 f"({', '.join(cargs)},))")
    lines += after
    lines.append(f"    return ({''.join(r + ', ' for r in rets)})")
    return "\n".join(lines) + "\n"


def _layout_fn(info: SpecInfo) -> str:
    pl = Planner(info, info.encode)
    pl.emit("_n = int(n_)")
    for d in info.static_decls:
        pl.stmt(d)
    entries = []
    for sec in info.sections:
        dt = "np.uint8" if sec.elem.packed else np_dtype(sec.elem)
        if sec.scalar:
            count = "1"
        else:
            expr = sec.length.expr if sec.length.expr is not None else sec.length.bound
            count = f"int({pl.scalar(expr)})"
            if sec.elem.packed:
                count = f"({count} * {sec.elem.bits} + 7) // 8"
        entries.append(f"(np.dtype({dt}), {count})")
    lines = ["def layout(n_, P):", '    """Return (dtype, count) of each section for n_ '
             'elements (bounds if variable)."""']
    lines += _param_lines(info)
    _emit_body(pl.block.stmts, "    ", lines)
    lines.append(f"    return [{', '.join(entries)}]")
    return "\n".join(lines) + "\n"


def _program_fn(info: SpecInfo, prog: Program, signature: str, doc: str) -> str:
    lines = [f"def {signature}:", f'    """{doc}"""']
    lines += _param_lines(info)
    _emit_body(prog.body, "    ", lines)
    return "\n".join(lines) + "\n"


def plan_summary(enc: Program, dec: Program) -> str:
    """Return a human-readable account of the fused loops (what each pass computes)."""
    out = []
    for prog in (enc, dec):
        out.append(f"{prog.name}: {len(prog.loops)} fused loop(s)")
        for lp in prog.loops:
            kinds = []
            for o in lp.outputs:
                if isinstance(o, Store):
                    kinds.append(f"store {o.arr.elem}[{lp.key}]")
                elif isinstance(o, Reduce):
                    kinds.append(f"reduce {o.op} -> {o.out.ty}")
                else:
                    kinds.append(f"filter -> int[] (+{len(o.values)} gathered)")
            out.append(f"  {lp.name} over {lp.key}: " + "; ".join(kinds))
    return "\n".join(out) + "\n"


def generate(info: SpecInfo, source: str, path: str) -> Dict[str, str]:
    """Generate the module of a checked spec.

    Args:
        info: the checked spec.
        source: the spec's text (kept in the module as ``SOURCE``).
        path: the spec file's name (kept as ``SPEC_FILE``); any text, written as a literal.

    Returns:
        ``{"module": Python source, "cuda": CUDA C source, "plan": fusion summary}``.

    Raises:
        CompLLError: the codec or a parameter name is not an identifier (see
            :func:`check_identifier`).
    """
    check_identifier(info.name, "codec name")
    for p in info.params:
        check_identifier(p.name, "parameter")
    enc, dec = plan(info)
    loops = enc.loops + dec.loops
    digest = spec_digest(source)
    params = [dict(name=p.name, kind=p.ty.kind, default=p.default, lo=p.lo, hi=p.hi,
                   lo_closed=p.lo_closed, hi_closed=p.hi_closed, range=p.describe_range())
              for p in info.params]
    cuda_src = cuda.module_source(loops)
    # The docstring holds only checked names and hex digits; every other value below is
    # written with py_literal (repr), never pasted as text.
    doc = (f"CompLL codec compll.{info.name}, generated from the spec file SPEC_FILE. "
           f"Do not edit.\n\nSpec sha256 {digest}, generator version {GENERATOR_VERSION}.\n")
    parts = [
        f'"""{doc}"""\n',
        "import numpy as np\n\nfrom hipress.compll import runtime as _rt\n\n"
        "_f32 = np.float32\n_f64 = np.float64\n",
        f"SPEC_NAME = {py_literal(info.name)}",
        f"CODEC_NAME = {py_literal(info.codec_name)}",
        f"SPEC_FILE = {py_literal(path)}",
        f"SPEC_SHA256 = {py_literal(digest)}",
        f"FLAGS = {py_literal(dict(info.flags))}",
        f"PARAMS = {py_literal(params)}",
        f"INPUT_DTYPE = np.dtype({np_dtype(info.input_elem)})",
        f"USES_RNG = {py_literal(bool(enc.uses_rng))}",
        f"USES_KEYS = {py_literal(bool(enc.uses_keys))}",
        f"SOURCE = {py_literal(source)}\n\n",
        _layout_fn(info),
        "\n" + _program_fn(info, enc, "encode(xp, _g, P, ctx)",
                           "Return the payload sections of the 1-D gradient g."),
        "\n" + _program_fn(info, dec, "decode(xp, sections, n, P, ctx)",
                           "Return the n decoded elements of a payload's sections."),
    ]
    for lp in loops:
        parts.append("\n" + _wrapper(lp))
    parts.append("\n# Numba kernels: compiled on first use (njit, cache=True).")
    for lp in loops:
        parts.append("\n" + cpu.kernel_source(lp))
    parts.append(f"\nCUDA_SOURCE = {py_literal(cuda_src)}\n")
    module = "\n".join(parts)
    return {"module": module, "cuda": cuda_src, "plan": plan_summary(enc, dec)}
