"""Numba backend: turn a planned :class:`~hipress.compll.plan.Loop` into Python source.

Each loop becomes one function compiled with ``numba.njit(cache=True)`` on first use.
It walks the elements in groups of 16: a group fills whole bytes of every packed output
(16 codes of b bits are 2b bytes, assembled in a 64-bit word and written once) and gives
each floating sum its 16 lanes (element i goes to lane i % 16, the order
:func:`hipress.codecs._kernels_quant.lane_sums` defines), so LLVM can vectorize the body.
The last, partial group runs the same body with a shorter trip count.

Per element, every distinct sub-expression is computed once (common subexpressions of
the loop's outputs are shared), and values keep their declared types: float arithmetic
is done in float32 (``np.float32`` operands), as in NumPy, the CUDA kernels and the
host code, so results agree bit for bit.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import numpy as np

from hipress.compll import typesys as T
from hipress.compll.plan import (
    GROUP,
    TE,
    Compact,
    Loop,
    Reduce,
    Store,
    TemplateEmitter,
    reduce_identity,
)

_NP = {"float": "np.float32", "double": "np.float64", "int": "np.int64", "long": "np.int64",
       "uint": "np.int64", "bool": "np.bool_"}


def literal(v, ty: T.Scalar) -> str:
    """Return a Numba-typed literal of ``ty``."""
    if ty.kind == "bool":
        return "True" if v else "False"
    if ty.is_float:
        v = float(v)
        text = repr(v) if np.isfinite(v) else ("np.inf" if v > 0 else "-np.inf")
        return f"{_NP[ty.kind]}({text})"
    return f"np.int64({int(v)})"


def conv(code: str, src: T.Scalar, dst: T.Scalar) -> str:
    """Convert ``code`` from ``src`` to ``dst`` (explicitly, so types never drift)."""
    if src == dst:
        return code
    if dst.is_float:
        return f"{_NP[dst.kind]}({code})"
    if dst.kind == "bool":
        return f"({code} != 0)"
    if dst.kind == "uint":
        return f"(np.int64({code}) & {dst.max_value})"
    return f"np.int64({code})"


class Emitter(TemplateEmitter):
    """Emit the per-element body of a loop as Numba Python, sharing equal sub-expressions."""

    literal = staticmethod(literal)
    conv = staticmethod(conv)
    NOT = "(not {x})"
    LOGIC = {"&&": "({x} and {y})", "||": "({x} or {y})"}
    COND = "({x} if {c} else {y})"
    MINMAX = {"min": "({y} if {y} < {x} else {x})", "max": "({y} if {y} > {x} else {x})"}

    def __init__(self, args: Dict[str, str], index: str = "i", group: int = GROUP) -> None:
        super().__init__(args, index)
        self.group = group
        self.pair_rand = False  # random(...) at the loop index: one hash per pair of elements
        self.group_loads: Dict[str, int] = {}  # packed inputs read whole per group: arg -> bits

    def declare(self, var: str, te: TE, code: str) -> str:
        """Return ``var = code``."""
        return f"{var} = {code}"

    def _load(self, te: TE) -> str:
        arr = te.val
        idx = self.value(te.args[0])
        name = self.args[arr.var]
        if arr.elem.packed and te.args[0].kind == "index" and self.index == "i":
            # codes of the current group were read into one word before the group
            b = arr.elem.bits
            self.group_loads[name] = b
            return (f"np.int64((gw_{name} >> np.uint64({b} * ({self.group - 1} - j))) & "
                    f"np.uint64({arr.elem.max_value}))")
        if arr.elem.packed:
            b = arr.elem.bits
            return (f"np.int64(({name}[({idx} * {b}) >> 3] >> (8 - {b} - (({idx} * {b}) & 7)))"
                    f" & {arr.elem.max_value})")
        if arr.elem.kind in ("int", "long", "uint"):
            return f"np.int64({name}[{idx}])"
        return f"{name}[{idx}]"

    def _rand(self, te: TE) -> str:
        if te.args[0].kind == "index" and self.index == "i":
            self.pair_rand = True
            return "_u24pair(zp[j >> 1], j)"
        return f"_u24f({self.value(te.args[0])}, key)"

    def _binary(self, op: str, t: T.Scalar, x: str, y: str) -> str:
        if op == "/" and not t.is_float:
            return f"_idiv({x}, {y})"
        if op == "%":
            return f"_imod({x}, {y})"
        return f"({x} {op} {y})"

    def _call(self, f: str, ty: T.Scalar, x: str) -> str:
        if f == "abs":
            return f"abs({x})"
        return f"{_NP[ty.kind]}(np.{f}({x}))"


def _identity(op: str, t: T.Scalar) -> str:
    v = reduce_identity(op, t)
    if isinstance(v, float):
        return "-np.inf" if v < 0 else "np.inf"
    return str(v)


def _elem_np(t: T.Scalar) -> str:
    return f"np.{np.dtype(t.dtype).name}"


def kernel_signature(loop: Loop) -> Tuple[List[str], Dict[str, str]]:
    """Return (kernel argument names, host var -> argument) of a loop's inputs."""
    arrays, scalars, rand = loop.inputs()
    mapping = loop.arg_names()
    names = ["n_"] + [mapping[h.var] for h in arrays + scalars] + (["key"] if rand else [])
    return names, mapping


def kernel_outputs(loop: Loop) -> List[str]:
    """Return the output-array argument names of a loop's kernel, in output order."""
    out = []
    for j, o in enumerate(loop.outputs):
        if isinstance(o, Store):
            out.append(f"out{j}")
        elif isinstance(o, Compact):
            out.append(f"idx{j}")
            out += [f"val{j}_{q}" for q in range(len(o.values))]
    return out


#: Emit group bodies of at most this many elements unrolled (constant shifts, lanes in
#: scalars); wider groups (16-lane floating sums) stay loops, which LLVM vectorizes itself.
#: Measured on the generated encoders at 16M elements: TBQ (groups of 4) 7.9 GB/s unrolled
#: vs 1.7 rolled; onebit (16 lanes) 5.1 GB/s rolled vs 1.2 unrolled.
UNROLL_MAX = 8
_LOCAL = re.compile(r"\b([vx]\d+)\b")
_J = re.compile(r"\bj\b")
_I = re.compile(r"\bi\b")


_LANE = re.compile(r"\blanes(\d+)\[j\]")


def _unroll(line: str, j: int) -> str:
    """Return an element line for element ``j`` of a group: j constant, locals renamed.

    Lanes become scalars ``lanes<k>_<j>`` and random pair words ``zp_<j // 2>``: values
    in registers, where arrays in memory would make LLVM assume they alias the inputs.
    """
    line = _LOCAL.sub(lambda m: f"{m.group(1)}_{j}", line)
    line = _LANE.sub(lambda m: f"lanes{m.group(1)}_{j}", line)
    line = line.replace("zp[j >> 1]", f"zp_{j >> 1}")
    line = _I.sub(f"i_{j}", line)
    return _J.sub(str(j), line)


def group_size(loop: Loop) -> int:
    """Elements per iteration of a loop's kernel.

    16 when the loop has a floating sum (its 16 lanes fix the order of additions), else
    the fewest that fill whole bytes of every packed output or input, at least 4: wider
    groups made LLVM's vectorizer emit much slower code for packing loops here (TBQ's
    encode: 1.8 GB/s with 16 elements per iteration, 17 GB/s with 4).
    """
    if any(isinstance(o, Reduce) and o.op == "+" and o.out.ty.is_float for o in loop.outputs):
        return GROUP
    g = 4
    for te in loop.templates():
        for node in te.walk():
            if node.kind == "load" and node.val.elem.packed and node.args[0].kind == "index":
                g = max(g, 8 // node.val.elem.bits)
    for o in loop.outputs:
        if isinstance(o, Store) and o.arr.elem.packed:
            g = max(g, 8 // o.arr.elem.bits)
    return g


def kernel_source(loop: Loop) -> str:
    """Return the Python source of the Numba kernel of ``loop`` (function ``_k<id>``)."""
    ins, mapping = kernel_signature(loop)
    outs = kernel_outputs(loop)
    body_lines, post_full, post_tail, init, final, ret = [], [], [], [], [], []
    to_array: List[str] = []  # scalar lanes of the unrolled groups -> arrays for the tail
    G = group_size(loop)  # noqa: N806 - the group size, as in the docs
    unroll = G <= UNROLL_MAX
    em = Emitter(mapping, group=G)
    group_words = []
    for j, o in enumerate(loop.outputs):
        if isinstance(o, Store):
            v = em.value(o.te)
            elem = o.arr.elem
            if elem.packed:
                b = elem.bits
                group_words.append(f"w{j}")
                body_lines.append(f"w{j} |= np.uint64({conv(v, o.te.ty, elem)}) << "
                                  f"np.uint64({b} * ({G - 1} - j))")
                nbytes = G * b // 8
                for q in range(nbytes):
                    post_full.append(f"out{j}[blk * {nbytes} + {q}] = np.uint8((w{j} >> "
                                     f"np.uint64({8 * (nbytes - 1 - q)})) & np.uint64(255))")
                post_tail.append(f"for q in range((rem * {b} + 7) // 8):")
                post_tail.append(f"    out{j}[nfull * {nbytes} + q] = np.uint8((w{j} >> "
                                 f"np.uint64(8 * ({nbytes - 1} - q))) & np.uint64(255))")
            else:
                body_lines.append(f"out{j}[i] = {conv(v, o.te.ty, elem)}")
        elif isinstance(o, Reduce):
            # 16 lanes (element i -> lane i % 16) for every reduction: independent
            # accumulators vectorize, and floating sums follow the lane order exactly.
            v = conv(em.value(o.te), o.te.ty, o.out.ty)
            t = o.out.ty
            lane_np = _NP[t.kind] if t.is_float else "np.int64"
            start = _identity(o.op, t)
            init += [f"lanes{j}_{q} = {lane_np}({start})" for q in range(G)] if unroll else \
                [f"lanes{j} = np.full({G}, {start}, {lane_np})"]
            to_array.append(f"lanes{j} = np.empty({G}, {lane_np})")
            to_array += [f"lanes{j}[{q}] = lanes{j}_{q}" for q in range(G)]
            if o.op == "+":
                body_lines.append(f"lanes{j}[j] += {v}")
                final.append(f"acc{j} = {literal(0.0, t) if t.is_float else 'np.int64(0)'}")
                final.append(f"for q in range({G}):")
                final.append(f"    acc{j} += lanes{j}[q]")
            else:
                cmp = ">" if o.op == "max" else "<"
                nan = f" | (x{j} != x{j})" if t.is_float else ""
                body_lines.append(f"x{j} = {v}")
                body_lines.append(f"lanes{j}[j] = x{j} if ((x{j} {cmp} lanes{j}[j]){nan}) "
                                  f"else lanes{j}[j]")
                final.append(f"acc{j} = lanes{j}[0]")
                final.append(f"for q in range(1, {G}):")
                final.append(f"    y{j} = lanes{j}[q]")
                ynan = f" or y{j} != y{j}" if t.is_float else ""
                final.append(f"    acc{j} = y{j} if (y{j} {cmp} acc{j}{ynan}) else acc{j}")
            ret.append(f"acc{j}")
        else:
            pred = conv(em.value(o.pred), o.pred.ty, T.BOOL)
            vals = [(conv(em.value(te), te.ty, arr.elem), q) for q, (te, arr) in
                    enumerate(o.values)]
            init.append(f"cnt{j} = 0")
            body_lines.append(f"if {pred}:")
            body_lines.append(f"    idx{j}[cnt{j}] = i")
            for v, q in vals:
                body_lines.append(f"    val{j}_{q}[cnt{j}] = {v}")
            body_lines.append(f"    cnt{j} += 1")
            ret.append(f"cnt{j}")
    elem_lines = em.lines + body_lines
    pro_full, pro_tail = [], []
    rolled_pro = [] if not em.pair_rand else [
        f"for q in range({G // 2}):", "    zp[q] = _smix(key, (base >> 1) + q)"]
    rolled_pro += [ln for ln in pro_full if not ln.startswith("zp_")]
    if em.pair_rand:
        init.append(f"zp = np.empty({G // 2}, np.uint64)")
        pro_full += [f"zp_{q} = _smix(key, (base >> 1) + {q})" for q in range(G // 2)]
        pro_tail += ["for q in range((rem + 1) // 2):", "    zp[q] = _smix(key, (base >> 1) + q)"]
    for name, b in em.group_loads.items():
        nb = G * b // 8
        shift_in = f"gw_{name} = (gw_{name} << np.uint64(8)) | np.uint64({name}"
        pro_full += [f"gw_{name} = np.uint64(0)", f"for q in range({nb}):",
                     f"    {shift_in}[blk * {nb} + q])"]
        pro_tail += [f"gw_{name} = np.uint64(0)", f"nb_{name} = (rem * {b} + 7) // 8",
                     f"for q in range(nb_{name}):", f"    {shift_in}[nfull * {nb} + q])",
                     f"gw_{name} = gw_{name} << np.uint64(8 * ({nb} - nb_{name}))"]
    src = [f"def _k{loop.id}({', '.join(ins + outs)}):"]
    src += [f"    {ln}" for ln in init]
    src.append(f"    nfull = n_ // {G}")
    src.append("    for blk in range(nfull):")
    src.append(f"        base = blk * {G}")
    src += [f"        {w} = np.uint64(0)" for w in group_words]
    if unroll:
        src += [f"        {ln}" for ln in pro_full]
        for jj in range(G):  # unrolled: constant shifts, lanes in registers
            src.append(f"        i_{jj} = base + {jj}")
            src += [f"        {_unroll(ln, jj)}" for ln in elem_lines]
    else:
        src += [f"        {ln}" for ln in rolled_pro]
        src.append(f"        for j in range({G}):")
        src.append("            i = base + j")
        src += [f"            {ln}" for ln in elem_lines]
    src += [f"        {ln}" for ln in post_full]
    if unroll:
        src += [f"    {ln}" for ln in to_array]
    src.append(f"    base = nfull * {G}")
    src.append("    rem = n_ - base")
    src.append("    if rem > 0:")
    src += [f"        {w} = np.uint64(0)" for w in group_words]
    src += [f"        {ln}" for ln in pro_tail]
    src.append("        for j in range(rem):")
    src.append("            i = base + j")
    src += [f"            {ln}" for ln in elem_lines]
    src += [f"        {ln}" for ln in post_tail]
    src += [f"    {ln}" for ln in final]
    src.append(f"    return ({''.join(r + ', ' for r in ret)})")
    return "\n".join(src) + "\n"


