"""Lower a checked spec to a host program plus fused loops (the middle of the generator).

Arrays in a spec are *templates* until something needs them in memory: an expression
that computes element ``i`` from loads of materialized arrays, captured scalars and the
loop index. ``map`` builds a bigger template, ``gather(a, idx)`` substitutes the index,
``random`` is a counter-based draw computed in place. Only four things make a template
real, each by adding an output to the *pending loop* of the template's length:

1. a store (the array is needed whole: a payload section, an argument of ``sort``...);
2. a reduction (``reduce(a, +)``: an accumulator, no array at all);
3. a compaction (``filter``: indices where a predicate holds, plus ``gather`` of
   same-length templates at those indices, in the same pass);
4. nothing else: loads of the input are never copied.

A pending loop runs (is *flushed*) only when the host program needs one of its results,
so every map, reduction, filter and packing over the same length that a spec writes
before it uses their results becomes one pass over memory. ``?:`` with array work in
its branches becomes a host ``if`` whose branches are planned separately (only the chosen
side runs, as in C).

The result is a :class:`Program` per function: host statements (Python source lines,
loop calls and ifs) and the loops with their outputs, which :mod:`hipress.compll.cpu`
and :mod:`hipress.compll.cuda` turn into kernels.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import math
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np

from hipress.compll import nodes as N
from hipress.compll import typesys as T
from hipress.compll.check import SpecInfo, walk
from hipress.compll.errors import CompLLTypeError

#: Elements handled per inner iteration: 16 float sums lanes and whole bytes of codes.
GROUP = 16


# ----------------------------------------------------------------------- templates
@dataclasses.dataclass(eq=False)
class TE:
    """An elementwise template: the value of element ``i`` of an array.

    kinds: ``const`` (val: Python number), ``host`` (val: HostScalar), ``index`` (the loop
    index), ``load`` (val: HostArr, args: (index,)), ``rand`` (args: (index,)), ``unary``
    / ``binary`` (val: operator; ``opty``: operand type), ``cond``, ``cast``, ``call``
    (val: function name).
    """

    kind: str
    ty: T.Scalar
    args: Tuple[TE, ...] = ()
    val: Any = None
    opty: Optional[T.Scalar] = None

    @property
    def key(self) -> tuple:
        """A structural key: equal keys compute equal values (for CSE)."""
        k = self.__dict__.get("_key")
        if k is None:
            v = self.val
            if isinstance(v, (HostArr, HostScalar)):
                v = v.var
            elif isinstance(v, float):
                v = ("f", repr(v))
            k = (self.kind, str(self.ty), v, str(self.opty), tuple(a.key for a in self.args))
            self.__dict__["_key"] = k
        return k

    def walk(self):
        """Yield this node and every node below it."""
        yield self
        for a in self.args:
            yield from a.walk()


def subst_index(te: TE, new_index: TE) -> TE:
    """Return ``te`` with the loop index replaced by ``new_index`` (a gather)."""
    if te.kind == "index":
        return new_index
    if not te.args:
        return te
    return dataclasses.replace(te, args=tuple(subst_index(a, new_index) for a in te.args))


@dataclasses.dataclass(eq=False)
class HostArr:
    """A materialized array held by a host variable.

    Attributes:
        var: the Python variable.
        elem: element type (codes of packed types are stored packed).
        length: Python expression of the element count (codes, not bytes).
        key: length key (equal keys, equal lengths).
        loop: the pending loop that will fill it, or None once it exists.
        untrusted: read from a payload (indices into it are bounds-checked).
    """

    var: str
    elem: T.Scalar
    length: str
    key: str
    loop: Optional[Loop] = None
    untrusted: bool = False
    compact: Any = None  # the Compact output that makes this index array


@dataclasses.dataclass(eq=False)
class HostScalar:
    """A scalar held by a host variable; ``loop`` is its pending producer, if any."""

    var: str
    ty: T.Scalar
    loop: Optional[Loop] = None


@dataclasses.dataclass(eq=False)
class ArrT:
    """An array value: a template over a length (``key``, Python ``length``)."""

    te: TE
    elem: T.Scalar
    key: str
    length: str
    host: Optional[HostArr] = None  # set when the template is a plain load of an array
    fuse: Any = None  # (Compact, Loop) when gathered at a pending filter's indices
    fuse_te: Optional[TE] = None  # the template gathered, over the filter's length


# --------------------------------------------------------------------------- loops
@dataclasses.dataclass(eq=False)
class Store:
    """Loop output: write the template to ``arr`` (packed for code types)."""

    te: TE
    arr: HostArr


@dataclasses.dataclass(eq=False)
class Reduce:
    """Loop output: reduce the template with ``op`` (+, max, min) into ``out``.

    Floating sums use 16 lanes (element i to lane i % 16, each lane summed in increasing
    i from +0.0, lanes added left to right); integer sums are exact in int64.
    """

    te: TE
    op: str
    out: HostScalar


@dataclasses.dataclass(eq=False)
class Compact:
    """Loop output: ascending int32 indices where ``pred`` holds, plus values there."""

    pred: TE
    idx: HostArr
    values: List[Tuple[TE, HostArr]]
    domain_key: str


@dataclasses.dataclass(eq=False)
class Loop:
    """One fused pass over ``length`` elements (Python expression) with several outputs."""

    id: int
    key: str
    length: str
    outputs: List[Any] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        """Name of the loop's wrapper function in the generated module."""
        return f"_loop{self.id}"

    def templates(self) -> List[TE]:
        """Every template the loop evaluates."""
        out = []
        for o in self.outputs:
            if isinstance(o, (Store, Reduce)):
                out.append(o.te)
            else:
                out.append(o.pred)
                out.extend(te for te, _ in o.values)
        return out

    def inputs(self) -> Tuple[List[HostArr], List[HostScalar], bool]:
        """Return (arrays loaded, scalars captured, uses random) in first-use order."""
        arrays: Dict[str, HostArr] = {}
        scalars: Dict[str, HostScalar] = {}
        rand = False
        for te in self.templates():
            for node in te.walk():
                if node.kind == "load":
                    arrays.setdefault(node.val.var, node.val)
                elif node.kind == "host":
                    scalars.setdefault(node.val.var, node.val)
                elif node.kind == "rand":
                    rand = True
        return list(arrays.values()), list(scalars.values()), rand

    def packed_stores(self) -> bool:
        """Whether the loop writes bit-packed codes."""
        return any(isinstance(o, Store) and o.arr.elem.packed for o in self.outputs)

    def arg_names(self) -> Dict[str, str]:
        """Return host variable -> kernel argument name of the loop's inputs.

        Arrays are ``in<i>`` and scalars ``s<i>``, numbered in :meth:`inputs` order; the
        CPU and CUDA kernels both take them under these names.
        """
        arrays, scalars, _ = self.inputs()
        names = {a.var: f"in{i}" for i, a in enumerate(arrays)}
        names.update({s.var: f"s{i}" for i, s in enumerate(scalars)})
        return names


def reduce_identity(op: str, t: T.Scalar) -> Any:
    """Return the starting value of a reduction: 0, -inf / +inf, or the int64 extremes.

    Args:
        op: ``"+"``, ``"max"`` or ``"min"``.
        t: the accumulator's type.

    Returns:
        An int (``+`` and integer types) or a float (+-inf for floating max/min).
    """
    if op == "+":
        return 0
    if t.is_float:
        return -math.inf if op == "max" else math.inf
    lim = np.iinfo(np.int64)
    return lim.min if op == "max" else lim.max


# ------------------------------------------------------------------ kernel bodies
class TemplateEmitter(abc.ABC):
    """Emit a kernel's per-element body, computing each distinct sub-expression once.

    The backends (:mod:`hipress.compll.cpu`: Numba Python; :mod:`hipress.compll.cuda`:
    CUDA C) subclass it for their language. The sharing of common subexpressions and the
    typing rules of the operands (which operand is converted to which type) are here,
    once, so CPU and GPU kernels compute the same values; the subclasses only spell the
    results: the syntax tables (``NOT``, ``LOGIC``, ``COND``, ``MINMAX``) and
    ``_load``, ``_rand``, ``_binary``, ``_call``, :meth:`literal`, :meth:`conv`,
    :meth:`declare`.

    Algorithm of :meth:`value`:
        1. Constants, captured scalars and the loop index are returned inline.
        2. A template already computed (same structural :attr:`TE.key`) returns its local.
        3. Otherwise :meth:`compute` builds the expression from the operands' locals
           (computed first, left to right), and :meth:`declare` appends a line binding it
           to a new local ``v<n>``.

    Args:
        args: host variable -> kernel argument name.
        index: the expression of the current element's index.
    """

    #: Target syntax, as ``str.format`` templates of operand expressions: bool negation
    #: (``x``), ``&&``/``||`` of bools (``x``, ``y``), ``c ? x : y`` (only the chosen side
    #: evaluated), and ``min``/``max`` of two values of one type (``x``, ``y``).
    NOT: ClassVar[str]
    LOGIC: ClassVar[Dict[str, str]]
    COND: ClassVar[str]
    MINMAX: ClassVar[Dict[str, str]]

    def __init__(self, args: Dict[str, str], index: str = "i") -> None:
        self.args = args
        self.index = index
        self.lines: List[str] = []
        self.memo: Dict[tuple, str] = {}
        self.n = 0

    @staticmethod
    @abc.abstractmethod
    def literal(v: Any, ty: T.Scalar) -> str:
        """Return a literal of ``v`` typed as ``ty`` in the target language."""

    @staticmethod
    @abc.abstractmethod
    def conv(code: str, src: T.Scalar, dst: T.Scalar) -> str:
        """Return ``code`` (of type ``src``) converted to ``dst``."""

    @abc.abstractmethod
    def declare(self, var: str, te: TE, code: str) -> str:
        """Return the line that binds local ``var`` to ``code`` (the value of ``te``)."""

    @abc.abstractmethod
    def _load(self, te: TE) -> str:
        """Return element ``te.args[0]`` of input array ``te.val``."""

    @abc.abstractmethod
    def _rand(self, te: TE) -> str:
        """Return the uniform draw of element ``te.args[0]`` of the keyed stream."""

    @abc.abstractmethod
    def _call(self, f: str, ty: T.Scalar, x: str) -> str:
        """Return ``f(x)`` for f in sqrt/floor/ceil/rint/abs, ``x`` and result of ``ty``."""

    def _binary(self, op: str, t: T.Scalar, x: str, y: str) -> str:
        """Return ``x op y`` with both operands of type ``t`` (the same in Python and C)."""
        return f"({x} {op} {y})"

    def compute(self, te: TE) -> str:
        """Return the expression computing ``te`` from its operands' locals."""
        k, a = te.kind, te.args
        if k == "load":
            return self._load(te)
        if k == "rand":
            return self._rand(te)
        if k == "unary":
            x = self.value(a[0])
            if te.val == "!":
                return self.NOT.format(x=self.conv(x, a[0].ty, T.BOOL))
            return f"(-{self.conv(x, a[0].ty, te.ty)})"
        if k == "binary":
            op = te.val
            if op in ("&&", "||"):
                x, y = self.value(a[0]), self.value(a[1])
                return self.LOGIC[op].format(x=self.conv(x, a[0].ty, T.BOOL),
                                             y=self.conv(y, a[1].ty, T.BOOL))
            t = te.opty
            return self._binary(op, t, self.typed(a[0], t), self.typed(a[1], t))
        if k == "cond":
            c = self.conv(self.value(a[0]), a[0].ty, T.BOOL)
            x, y = self.typed(a[1], te.ty), self.typed(a[2], te.ty)
            return self.COND.format(c=c, x=x, y=y)
        if k == "cast":
            return self.conv(self.value(a[0]), a[0].ty, te.ty)
        if k == "call":
            f = te.val
            if f in ("min", "max"):
                t = te.opty
                x = self.conv(self.value(a[0]), a[0].ty, t)
                y = self.conv(self.value(a[1]), a[1].ty, t)
                return self.MINMAX[f].format(x=x, y=y)
            return self._call(f, te.ty, self.conv(self.value(a[0]), a[0].ty, te.ty))
        raise AssertionError(f"unknown template kind {k}")  # pragma: no cover

    def value(self, te: TE) -> str:
        """Return an expression (often a local) holding ``te`` for the current element."""
        k = te.kind
        if k == "const":
            return self.literal(te.val, te.ty)
        if k == "host":
            return self.args[te.val.var]
        if k == "index":
            return self.index
        hit = self.memo.get(te.key)
        if hit is not None:
            return hit
        code = self.compute(te)
        var = f"v{self.n}"
        self.n += 1
        self.lines.append(self.declare(var, te, code))
        self.memo[te.key] = var
        return var

    def typed(self, te: TE, dst: T.Scalar) -> str:
        """Return ``te`` converted to ``dst`` (constants become literals of ``dst``)."""
        if te.kind == "const" and not (dst.kind == "bool") and not (
                isinstance(te.val, float) and not dst.is_float):
            return self.literal(te.val, dst)
        return self.conv(self.value(te), te.ty, dst)


# ------------------------------------------------------------------- host program
@dataclasses.dataclass(eq=False)
class If:
    """A host ``if``: ``cond`` is Python source; branches are statement lists."""

    cond: str
    then: List[Any]
    other: List[Any]


@dataclasses.dataclass(eq=False)
class LoopCall:
    """Run a loop at this point of the host program."""

    loop: Loop


@dataclasses.dataclass
class Program:
    """A planned function: host statements (str, LoopCall, If) and its loops."""

    name: str
    body: List[Any]
    loops: List[Loop]
    uses_rng: bool = False
    uses_keys: bool = False


class _Block:
    def __init__(self, parent: Optional[_Block] = None) -> None:
        self.parent = parent
        self.stmts: List[Any] = []
        self.pending: Dict[str, Loop] = {}
        self.wanted: Dict[str, List[Any]] = {}


def py_literal(v: Any, ty: T.Scalar) -> str:
    """Return Python source of literal ``v`` typed as ``ty`` (floats via np.float32/64)."""
    if ty.is_float:
        v = float(v)
        text = repr(v) if np.isfinite(v) else f"float({str(v)!r})"
        return f"{'_f32' if ty.kind == 'float' else '_f64'}({text})"
    if ty.kind == "bool":
        return "True" if v else "False"
    return str(int(v))


PY_CAST = {"float": "_f32", "double": "_f64"}


def py_conv(code: str, src: T.Scalar, dst: T.Scalar) -> str:
    """Return Python source converting ``code`` (of type ``src``) to ``dst``."""
    if src == dst:
        return code
    if dst.kind in PY_CAST:
        return f"{PY_CAST[dst.kind]}({code})"
    if dst.kind == "bool":
        return f"bool({code})"
    inner = f"_rt.trunc({code})" if src.is_float else f"int({code})"
    if dst.kind == "uint":
        return f"({inner} & {dst.max_value})"
    return inner


class Planner:
    """Plans one function of a checked spec; see the module docstring."""

    def __init__(self, info: SpecInfo, fn: N.Function) -> None:
        self.info = info
        self.fn = fn
        self.ids = itertools.count()
        self.loops: List[Loop] = []
        self.block = _Block()
        self.env: Dict[str, Any] = {}  # Sym.uid -> HostScalar | ArrT | HostArr
        self.mat_cache: Dict[tuple, Tuple[_Block, HostArr]] = {}
        self.uses_rng = False
        self.uses_keys = False
        self.input: Optional[HostArr] = None
        # Named arrays that will be stored whole (payload sections): stored by the first
        # pass over their length that runs, so the payload costs no pass of its own.
        self.wanted = _stored_names(fn)

    # ------------------------------------------------------------------ utilities
    def tmp(self, prefix: str = "t") -> str:
        """Return a fresh host variable name."""
        return f"_{prefix}{next(self.ids)}"

    def emit(self, line: Any) -> None:
        """Append a host statement to the current block."""
        self.block.stmts.append(line)

    def error(self, node: Any, msg: str) -> CompLLTypeError:
        """Return an error located at ``node``."""
        spec = self.info.spec
        return CompLLTypeError(msg, node.line, node.col, spec.path, spec.source)

    def flush(self, loop: Loop) -> None:
        """Run ``loop`` now: emit its call and make its outputs available."""
        blk = self.block
        if blk.pending.get(loop.key) is not loop:  # pragma: no cover - planner invariant
            raise AssertionError("a pending loop of an enclosing block must be flushed first")
        for key, wanted in blk.wanted.items():
            for arr_val in list(wanted):
                hit = self.mat_cache.get(arr_val.te.key)
                if hit is not None and hit[0] is blk:
                    wanted.remove(arr_val)
                elif arr_val.fuse is not None and arr_val.fuse[1] is loop:
                    wanted.remove(arr_val)
                    self.fuse_store(arr_val)
                elif key == loop.key and not _reads_pending(arr_val.te):
                    wanted.remove(arr_val)
                    arr = HostArr(self.tmp("a"), arr_val.elem, arr_val.length, arr_val.key, loop)
                    loop.outputs.append(Store(arr_val.te, arr))
                    self.mat_cache[arr_val.te.key] = (blk, arr)
        del blk.pending[loop.key]
        blk.stmts.append(LoopCall(loop))
        for o in loop.outputs:
            for arr in _produced(o):
                arr.loop = None

    def flush_all(self) -> None:
        """Run every pending loop of the current block, oldest first."""
        for loop in sorted(self.block.pending.values(), key=lambda lp: lp.id):
            if self.block.pending.get(loop.key) is loop:
                self.flush(loop)

    def ready_scalar(self, s: HostScalar) -> str:
        """Return the variable of ``s``, flushing its loop if needed."""
        if s.loop is not None:
            self.flush(s.loop)
        return s.var

    def ready_array(self, a: HostArr) -> HostArr:
        """Return ``a`` after flushing the loop that fills it, if pending."""
        if a.loop is not None:
            self.flush(a.loop)
        return a

    def ready_template(self, a: ArrT) -> None:
        """Flush the loops filling arrays that ``a`` loads (its length may name them)."""
        for node in a.te.walk():
            if node.kind in ("load", "host") and node.val.loop is not None:
                self.flush(node.val.loop)

    def loop_for(self, key: str, length: str, te_list: List[TE]) -> Loop:
        """Return the pending loop over ``key`` that may evaluate ``te_list`` now.

        Results of a pending loop that these templates read (arrays it fills, scalars it
        reduces) force that loop to run first; the templates then go to a fresh loop.
        """
        for te in te_list:
            for node in te.walk():
                if node.kind in ("load", "host") and node.val.loop is not None:
                    self.flush(node.val.loop)
        loop = self.block.pending.get(key)
        if loop is None:
            loop = Loop(next(self.ids), key, length)
            self.loops.append(loop)
            self.block.pending[key] = loop
        return loop

    # -------------------------------------------------------------- materializing
    def materialize(self, a: Any) -> HostArr:
        """Return a HostArr holding array value ``a`` (a store in a pending loop if needed)."""
        if isinstance(a, HostArr):
            return self.ready_array(a)
        if a.host is not None:
            return self.ready_array(a.host)
        hit = self.mat_cache.get(a.te.key)
        if hit is not None:
            blk, arr = hit
            b: Optional[_Block] = self.block
            while b is not None and b is not blk:
                b = b.parent
            if b is not None:
                return self.ready_array(arr)
        if a.fuse is not None:
            arr = self.fuse_store(a)
            if arr is not None:
                return self.ready_array(arr)
        self.ready_template(a)
        loop = self.loop_for(a.key, a.length, [a.te])
        arr = HostArr(self.tmp("a"), a.elem, a.length, a.key, loop)
        loop.outputs.append(Store(a.te, arr))
        self.mat_cache[a.te.key] = (self.block, arr)
        return self.ready_array(arr)

    def fuse_store(self, a: ArrT) -> Optional[HostArr]:
        """Compute ``gather(x, filter(...))`` in the filter's pass if it is still pending."""
        comp, loop = a.fuse
        if self.block.pending.get(loop.key) is not loop or _reads_pending(a.fuse_te):
            return None
        arr = HostArr(self.tmp("a"), a.elem, f"{comp.idx.var}.size", a.key, loop)
        comp.values.append((a.fuse_te, arr))
        self.mat_cache[a.te.key] = (self.block, arr)
        return arr

    @staticmethod
    def as_template(a: Any) -> ArrT:
        """Return array value ``a`` as a template (a load for a HostArr)."""
        if isinstance(a, ArrT):
            return a
        te = TE("load", a.elem, (TE("index", T.LONG),), a)
        return ArrT(te, a.elem, a.key, a.length, a)

    # ------------------------------------------------------------------- programs
    def plan_encode(self) -> Program:
        """Plan encode: host statements, loops, and the list of payload sections."""
        info = self.info
        self.emit("_n = _g.size")
        self.input = HostArr("_g", info.input_elem, "_n", info.encode_length)
        for st in self.fn.body[:-1]:
            self.stmt(st)
        names = [self.section(sec) for sec in info.sections]
        self.flush_all()
        self.emit(f"return [{', '.join(names)}]")
        return Program("encode", self.block.stmts, self.loops, self.uses_rng, self.uses_keys)

    def section(self, sec: Any) -> str:
        """Return the host variable of one payload section (a 1-D array)."""
        e = sec.expr
        if sec.scalar or isinstance(e, N.ArrayLit):
            items = e.items if isinstance(e, N.ArrayLit) else [e]
            codes = [self.sconv(it, sec.elem) for it in items]
            var = self.tmp("s")
            self.emit(f"{var} = _rt.small(xp, [{', '.join(codes)}], {np_dtype(sec.elem)})")
            return var
        return self.materialize(self.array(e)).var

    def plan_decode(self) -> Program:
        """Plan decode: bind the payload's sections, return the decoded array."""
        self.emit("_n = n")
        for st in self.fn.body[:-1]:
            self.stmt(st)
        arr = self.materialize(self.array(self.fn.body[-1].expr))
        self.flush_all()
        self.emit(f"return {arr.var}")
        return Program("decode", self.block.stmts, self.loops, self.uses_rng, self.uses_keys)

    # ---------------------------------------------------------------- statements
    def stmt(self, st: N.Stmt) -> None:
        """Plan one statement of encode or decode."""
        if isinstance(st, N.Decl):
            if isinstance(st.sym.ty, T.Scalar):
                e = st.expr
                if isinstance(e, N.Call) and e.fn == "reduce" and e.ty == st.sym.ty:
                    # Bound to the pending accumulator: reductions written one after the
                    # other stay in one pass until a statement reads one of them.
                    self.env[st.sym.uid] = self.reduce(e, ready=False)
                    return
                self.emit(f"{st.sym.uid} = {self.sconv(e, st.sym.ty)}")
                self.env[st.sym.uid] = HostScalar(st.sym.uid, st.sym.ty)
            else:
                val = self.array(st.expr)
                self.env[st.sym.uid] = val
                if st.name in self.wanted and isinstance(val, ArrT) and val.host is None:
                    self.block.wanted.setdefault(val.key, []).append(val)
        elif isinstance(st, N.LambdaDecl):
            return
        elif isinstance(st, N.Unpack):
            self.unpack(st)
        elif isinstance(st, N.CheckFinite):
            for e in st.args:
                code = self.scalar(e)
                what = e.id if isinstance(e, N.Name) else f"value at line {e.line}"
                self.emit(f"_rt.check_finite({code}, ctx.name, {what!r})")
        else:  # pragma: no cover - the checker allows nothing else
            raise self.error(st, "unsupported statement")

    def unpack(self, st: N.Unpack) -> None:
        """Bind the payload's sections (their dtypes and sizes are checked by the codec)."""
        for i, sym in enumerate(st.syms):
            if sym.kind == "scalar":
                self.emit(f"{sym.uid} = _rt.item(sections[{i}], 0, {np_dtype(sym.ty)})")
                self.env[sym.uid] = HostScalar(sym.uid, sym.ty)
                continue
            arr_t: T.Array = sym.ty
            var = sym.uid
            self.emit(f"{var} = sections[{i}]")
            bits = arr_t.elem.bits if arr_t.elem.packed else 0
            if sym.same_as is not None:
                other = self.env[sym.same_as.uid]
                self.emit(f"_rt.check_section_length({var}, {other.length}, 0, {i})")
                self.env[sym.uid] = HostArr(var, arr_t.elem, other.length, arr_t.length.key,
                                            untrusted=True)
            elif arr_t.length.expr is not None:
                lvar = self.tmp("len")
                self.emit(f"{lvar} = {self.scalar(arr_t.length.expr)}")
                self.emit(f"_rt.check_section_length({var}, {lvar}, {bits}, {i})")
                self.env[sym.uid] = HostArr(var, arr_t.elem, lvar, arr_t.length.key,
                                            untrusted=True)
            else:
                self.env[sym.uid] = HostArr(var, arr_t.elem, f"{var}.size", arr_t.length.key,
                                            untrusted=True)

    # --------------------------------------------------------------- array values
    def array(self, e: N.Expr) -> Any:
        """Return the value of array expression ``e`` (ArrT or HostArr)."""
        if isinstance(e, N.Name):
            if e.sym.role == "input":
                return self.input
            return self.env[e.sym.uid]
        if isinstance(e, N.Cond):
            return self.cond(e)
        if isinstance(e, N.ArrayLit):
            items = [self.sconv(it, e.ty.elem) for it in e.items]
            var = self.tmp("lit")
            self.emit(f"{var} = _rt.small(xp, [{', '.join(items)}], {np_dtype(e.ty.elem)})")
            return HostArr(var, e.ty.elem, str(len(items)), e.ty.length.key)
        return getattr(self, "_a_" + e.fn)(e)

    def _a_map(self, e: N.Call) -> ArrT:
        args = [self.as_template(self.array(a)) for a in e.args[:-1]]
        te = self.inline(e.lam, [a.te for a in args])
        return ArrT(te, e.lam.ty.ret, args[0].key, args[0].length)

    def _a_gather(self, e: N.Call) -> ArrT:
        src = self.as_template(self.array(e.args[0]))
        idx_val = self.array(e.args[1])
        idx = self.as_template(idx_val)
        if idx.host is not None and idx.host.untrusted:
            self.ready_array(idx.host)
            self.emit(f"_rt.check_indices({idx.host.var}, {src.length})")
        index = idx.te if idx.te.ty == T.LONG else TE("cast", T.LONG, (idx.te,))
        out = ArrT(subst_index(src.te, index), src.elem, idx.key, idx.length)
        comp = getattr(idx.host, "compact", None) if idx.host is not None else None
        if comp is not None and idx.host.loop is not None and comp.domain_key == src.key:
            out.fuse = (comp, idx.host.loop)
            out.fuse_te = src.te
        return out

    def _a_random(self, e: N.Call) -> ArrT:
        lvar = self.tmp("len")
        self.emit(f"{lvar} = {self.scalar(e.args[0])}")
        self.uses_keys = True
        return ArrT(TE("rand", T.FLOAT, (TE("index", T.LONG),)), T.FLOAT, e.ty.length.key, lvar)

    def _a_randint(self, e: N.Call) -> HostArr:
        lo, hi, m = (self.scalar(a) for a in e.args)
        var = self.tmp("ri")
        self.uses_rng = True
        self.emit(f"{var} = _rt.randint(xp, ctx.rng(xp), {lo}, {hi}, {m})")
        return HostArr(var, T.LONG, f"{var}.size", e.ty.length.key)

    def _a_filter(self, e: N.Call) -> HostArr:
        args = [self.as_template(self.array(a)) for a in e.args[:-1]]
        pred = self.inline(e.lam, [a.te for a in args])
        loop = self.loop_for(args[0].key, args[0].length, [pred])
        var = self.tmp("idx")
        idx = HostArr(var, T.INT, f"{var}.size", e.ty.length.key, loop)
        comp = Compact(pred, idx, [], args[0].key)
        loop.outputs.append(comp)
        idx.compact = comp
        return idx

    def _a_first(self, e: N.Call) -> HostArr:
        a = self.materialize(self.array(e.args[0]))
        var = self.tmp("first")
        self.emit(f"{var} = {a.var}[:max(0, {self.scalar(e.args[1])})]")
        return HostArr(var, a.elem, f"{var}.size", e.ty.length.key, untrusted=a.untrusted)

    def _a_sort(self, e: N.Call) -> HostArr:
        a = self.materialize(self.array(e.args[0]))
        var = self.tmp("sorted")
        self.emit(f"{var} = xp.sort({a.var})")
        return HostArr(var, a.elem, f"{var}.size", e.ty.length.key)

    def _a_topk(self, e: N.Call) -> HostArr:
        a = self.materialize(self.array(e.args[0]))
        var = self.tmp("top")
        self.emit(f"{var} = _rt.topk(xp, {a.var}, {self.scalar(e.args[1])})")
        return HostArr(var, T.INT, f"{var}.size", e.ty.length.key)

    def _a_scatter(self, e: N.Call) -> HostArr:
        idx = self.materialize(self.array(e.args[0]))
        vals = self.materialize(self.array(e.args[1]))
        lvar = self.tmp("len")
        self.emit(f"{lvar} = {self.scalar(e.args[2])}")
        var = self.tmp("sc")
        self.emit(f"{var} = _rt.scatter(xp, {idx.var}, {vals.var}, {lvar}, "
                  f"{np_dtype(vals.elem)})")
        return HostArr(var, vals.elem, lvar, e.ty.length.key)

    def cond(self, e: N.Cond) -> Any:
        """Plan ``c ? a : b`` whose sides do array work as a host if/else (one side runs)."""
        c = self.scalar(e.cond)
        self.flush_all()
        outer = self.block
        var = self.tmp("c")
        branches, results = [], []
        for side in (e.then, e.other):
            self.block = _Block(outer)
            if isinstance(e.ty, T.Array):
                val = self.materialize(self.array(side))
                self.flush_all()
                self.emit(f"{var} = {val.var}")
                results.append(val)
            else:
                code = self.sconv(side, e.ty)
                self.flush_all()
                self.emit(f"{var} = {code}")
            branches.append(self.block.stmts)
            self.block = outer
        self.emit(If(c, branches[0], branches[1]))
        if not isinstance(e.ty, T.Array):
            return var
        a, b = results
        length = a.length if (a.key == b.key and a.length == b.length) else f"{var}.size"
        return HostArr(var, e.ty.elem, length, e.ty.length.key,
                       untrusted=a.untrusted or b.untrusted)

    # -------------------------------------------------------------- scalar values
    def sconv(self, e: N.Expr, dst: T.Scalar) -> str:
        """Return Python source of scalar ``e`` converted to ``dst`` (literals exactly)."""
        const = _constant(e)
        if const is not None and dst.kind != "bool" and not isinstance(const, bool) and (
                dst.is_float or not isinstance(const, float)):
            return py_literal(const, dst)
        return py_conv(self.scalar(e), e.ty, dst)

    def scalar(self, e: N.Expr) -> str:
        """Return Python source computing scalar ``e`` (emitting statements as needed)."""
        return getattr(self, "_s_" + type(e).__name__)(e)

    def _s_Num(self, e: N.Num) -> str:
        return py_literal(e.value, e.ty)

    def _s_BoolLit(self, e: N.BoolLit) -> str:
        return "True" if e.value else "False"

    def _s_Name(self, e: N.Name) -> str:
        sym = e.sym
        if sym.role == "const":
            return py_literal(sym.node, sym.ty)
        if sym.role == "param":
            return f"P_{sym.name}"
        if sym.role == "length":
            return "_n"
        return self.ready_scalar(self.env[sym.uid])

    def _s_Unary(self, e: N.Unary) -> str:
        if e.op == "!":
            return f"(not {self.scalar(e.expr)})"
        const = _constant(e)
        if const is not None:
            return py_literal(const, e.ty)
        return f"(-{self.sconv(e.expr, e.ty)})"

    def _s_Binary(self, e: N.Binary) -> str:
        if e.op in ("&&", "||"):
            if _has_host_work(e.right):
                raise self.error(e.right, f"the right side of {e.op} cannot call array "
                                          "operators (it may not run); compute it first")
            a, b = self.scalar(e.left), self.scalar(e.right)
            return f"(bool({a}) {'and' if e.op == '&&' else 'or'} bool({b}))"
        if e.op in ("==", "!=") and e.left.ty.kind == "bool" and e.right.ty.kind == "bool":
            return f"({self.scalar(e.left)} {e.op} {self.scalar(e.right)})"
        t = e.operand_ty
        a, b = self.sconv(e.left, t), self.sconv(e.right, t)
        if e.op == "/" and not t.is_float:
            return f"_rt.idiv({a}, {b})"
        if e.op == "%":
            return f"_rt.imod({a}, {b})"
        return f"({a} {e.op} {b})"

    def _s_Cond(self, e: N.Cond) -> str:
        if not (_has_host_work(e.then) or _has_host_work(e.other)):
            c = self.scalar(e.cond)
            a = self.sconv(e.then, e.ty)
            b = self.sconv(e.other, e.ty)
            return f"({a} if {c} else {b})"
        return self.cond(e)

    def _s_Index(self, e: N.Index) -> str:
        arr = self.materialize(self.array(e.array))
        bits = arr.elem.bits if arr.elem.packed else 0
        return f"_rt.item({arr.var}, {self.scalar(e.index)}, {np_dtype(arr.elem)}, {bits})"

    def _s_Cast(self, e: N.Cast) -> str:
        return self.sconv(e.expr, e.ty)

    def _s_Call(self, e: N.Call) -> str:
        f = e.fn
        if f == "len":
            t = e.args[0].ty
            if not t.length.dynamic:
                return self.scalar(t.length.expr)
            a = self.array(e.args[0])
            if isinstance(a, HostArr):
                self.ready_array(a)
            else:
                self.ready_template(a)
            return a.length
        if f == "reduce":
            return self.reduce(e, ready=True).var
        if f == "kth":
            a = self.materialize(self.array(e.args[0]))
            return f"_rt.kth(xp, {a.var}, {self.scalar(e.args[1])}, {np_dtype(a.elem)})"
        if f in ("min", "max"):
            a, b = (self.sconv(x, e.operand_ty) for x in e.args)
            return f"_rt.s{f}({a}, {b})"
        a = self.sconv(e.args[0], e.ty)
        if f == "abs":
            return f"abs({a})"
        return f"np.{f}({a})"

    def reduce(self, e: N.Call, ready: bool) -> HostScalar:
        """Add a reduction to the pending loop over its array; flush it if ``ready``."""
        arr = self.as_template(self.array(e.args[0]))
        te = arr.te if arr.te.ty == e.ty else TE("cast", e.ty, (arr.te,))
        loop = self.loop_for(arr.key, arr.length, [te])
        out = HostScalar(self.tmp("r"), e.ty, loop)
        loop.outputs.append(Reduce(te, e.reduce_op, out))
        if ready:
            self.ready_scalar(out)
        return out

    # ------------------------------------------------------------------ lambdas
    def inline(self, lam: N.Lambda, args: List[TE]) -> TE:
        """Return the template of ``lam`` applied to element templates ``args``."""
        env: Dict[str, TE] = {}
        for (_, pname), a, pty in zip(lam.params, args, lam.ty.params):
            env[pname] = a if a.ty == pty else TE("cast", pty, (a,))
        for loc in lam.locals:
            v = self.te(loc.expr, env)
            env[loc.name] = v if v.ty == loc.sym.ty else TE("cast", loc.sym.ty, (v,))
        r = self.te(lam.result, env)
        return r if r.ty == lam.ty.ret else TE("cast", lam.ty.ret, (r,))

    def te(self, e: N.Expr, env: Dict[str, TE]) -> TE:
        """Return the template of expression ``e`` of a lambda body."""
        const = _constant(e)
        if const is not None:
            return TE("const", e.ty, (), const)
        if not _uses_locals(e):
            # Independent of the element: computed once on the host and captured.
            var = self.tmp("k")
            self.emit(f"{var} = {self.scalar(e)}")
            return TE("host", e.ty, (), HostScalar(var, e.ty))
        if isinstance(e, N.Name):
            return env[e.id]
        if isinstance(e, N.Unary):
            a = self.te(e.expr, env)
            if e.op == "!":
                return TE("unary", T.BOOL, (a,), "!", a.ty)
            return TE("unary", e.ty, (a,), "-", e.ty)
        if isinstance(e, N.Binary):
            a, b = self.te(e.left, env), self.te(e.right, env)
            if e.op in ("&&", "||") or (e.op in ("==", "!=") and a.ty.kind == "bool"
                                        and b.ty.kind == "bool"):
                return TE("binary", T.BOOL, (a, b), e.op, T.BOOL)
            return TE("binary", e.ty, (a, b), e.op, e.operand_ty)
        if isinstance(e, N.Cond):
            return TE("cond", e.ty, (self.te(e.cond, env), self.te(e.then, env),
                                     self.te(e.other, env)))
        if isinstance(e, N.Cast):
            return TE("cast", e.ty, (self.te(e.expr, env),))
        if isinstance(e, N.Call):
            args = tuple(self.te(a, env) for a in e.args)
            return TE("call", e.ty, args, e.fn, getattr(e, "operand_ty", None))
        raise self.error(e, "unsupported expression in a lambda")  # pragma: no cover


def _reads_pending(te: TE) -> bool:
    """Whether a template reads an array or scalar that a pending loop still has to make."""
    return any(n.kind in ("load", "host") and n.val.loop is not None for n in te.walk())


def _produced(o: Any) -> List[Any]:
    if isinstance(o, Store):
        return [o.arr]
    if isinstance(o, Reduce):
        return [o.out]
    return [o.idx] + [arr for _, arr in o.values]


def _constant(e: N.Expr) -> Any:
    """Return the value of a literal (``2``, ``-0.5``, ``true``, ``inf``), else None."""
    if isinstance(e, N.Num):
        return e.value
    if isinstance(e, N.BoolLit):
        return e.value
    if isinstance(e, N.Name) and getattr(e, "sym", None) is not None and e.sym.role == "const":
        return e.sym.node
    if isinstance(e, N.Unary) and e.op == "-" and isinstance(e.expr, N.Num):
        return -e.expr.value
    return None


def _stored_names(fn: N.Function) -> set:
    """Names of arrays passed whole to concat (payload sections)."""
    out = set()
    ret = fn.body[-1] if fn.body else None
    if isinstance(ret, N.Return) and isinstance(ret.expr, N.Call) and ret.expr.fn == "concat":
        for a in ret.expr.args:
            if isinstance(a, N.Name):
                out.add(a.id)
    return out


def np_dtype(t: T.Scalar) -> str:
    """Return the NumPy dtype of ``t`` as Python source."""
    return f"np.{np.dtype(t.dtype).name}"


def _has_host_work(e: N.Expr) -> bool:
    """Whether evaluating ``e`` runs array operators (needs statements, not an expression)."""
    for x in walk(e):
        if isinstance(x, N.Call) and x.fn in ("reduce", "kth", "map", "filter", "gather",
                                              "scatter", "sort", "topk", "random", "randint"):
            return True
        if isinstance(x, N.Call) and x.fn == "len" and x.static is False:
            return True
        if isinstance(x, N.Index):
            return True
    return False


def _uses_locals(e: N.Expr) -> bool:
    """Whether ``e`` reads a lambda parameter or local (depends on the element)."""
    return any(isinstance(x, N.Name) and getattr(x, "sym", None) is not None
               and x.sym.role in ("lparam", "llocal") for x in walk(e))


def plan(info: SpecInfo) -> Tuple[Program, Program]:
    """Plan encode and decode of a checked spec.

    Returns:
        (encode program, decode program).
    """
    enc = Planner(info, info.encode).plan_encode()
    dec = Planner(info, info.decode).plan_decode()
    return enc, dec
