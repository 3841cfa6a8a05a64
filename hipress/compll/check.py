"""Type checker of CompLL specs: every error is caught here, before code generation.

:func:`check` annotates each expression of a parsed spec with its type (``ty``), whether
its value depends only on the gradient length and the parameters (``static``), and the
symbol each name refers to (``sym``), and returns a :class:`SpecInfo` that the code
generators read. Rules, in short:

1. Arithmetic promotes bool and ``uint<b>`` to int, then int < long < float < double.
   Literals are weak: ``v * 2`` with ``v`` a float stays float.
2. Storing a value narrows only where nothing can be lost silently: a float never goes
   into an integer or a code (``uint<2> c = 0.5`` is an error; write ``uint<2>(int(x))``
   or a comparison), an int goes into ``uint<b>`` only as a literal (or ternary of
   literals) in range or through an explicit cast.
3. Lambdas are elementwise: they see their parameters, their locals and the scalars of
   the enclosing function (captured), never whole arrays.
4. Arrays carry symbolic lengths; ``map`` over several arrays needs equal lengths, and
   every payload section needs a length computable from ``n`` and the parameters (or an
   upper bound, for codecs declared ``variable_size``).
5. ``decode`` extracts the sections ``encode`` concatenates, in order, with equal types.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Dict, List, Optional, Tuple

from hipress.compll import nodes as N
from hipress.compll import typesys as T
from hipress.compll.errors import CompLLTypeError

FLAGS = ("error_feedback", "variable_size", "stochastic", "lossless")
ARRAY_OPS = ("map", "reduce", "filter", "gather", "scatter", "sort", "topk", "kth", "first",
             "random", "randint", "concat", "extract", "len")
SCALAR_FUNCS = ("abs", "sqrt", "floor", "ceil", "rint", "min", "max")
CONSTANTS = {"inf": math.inf}
RESERVED = set(ARRAY_OPS) | set(SCALAR_FUNCS) | set(CONSTANTS) | {
    "seed", "name", "step", "rank", "np", "xp", "ctx", "sections", "P"}
_IDENT = re.compile(r"[a-z][a-z0-9_]*")


@dataclasses.dataclass(eq=False)
class Sym:
    """What a name refers to.

    Attributes:
        name: the name as written.
        kind: ``scalar``, ``array``, ``lambda`` or ``payload``.
        ty: its type.
        role: ``param``, ``length``, ``local``, ``input``, ``section``, ``lparam``
            (lambda parameter), ``llocal`` (lambda local) or ``const``.
        static: the value depends only on the gradient length and the parameters.
        node: the defining node (Decl, Lambda, LocalDecl...), if any.
        uid: a name unique within the spec, used in generated code.
    """

    name: str
    kind: str
    ty: Any
    role: str
    static: bool = False
    node: Any = None
    uid: str = ""


@dataclasses.dataclass
class ParamInfo:
    """A codec parameter: name, scalar type, default and admissible interval."""

    name: str
    ty: T.Scalar
    default: Any
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_closed: bool = True
    hi_closed: bool = True

    def describe_range(self) -> str:
        """Return the interval as written, e.g. ``(0, 1]``."""
        lo = "-inf" if self.lo is None else _fmt(self.lo)
        hi = "inf" if self.hi is None else _fmt(self.hi)
        return f"{'[' if self.lo_closed else '('}{lo}, {hi}{']' if self.hi_closed else ')'}"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and not math.isinf(v) else repr(v)


@dataclasses.dataclass
class Section:
    """One payload section as concatenated by encode.

    Attributes:
        elem: element type (packed for ``uint<b>``, b < 8).
        length: the number of elements (codes, not bytes, for packed types).
        scalar: the section is a single scalar.
        expr: the concatenated expression.
    """

    elem: T.Scalar
    length: T.Length
    scalar: bool
    expr: Any


@dataclasses.dataclass
class SpecInfo:
    """Everything the generators need about a checked spec."""

    spec: N.Spec
    name: str
    codec_name: str
    params: List[ParamInfo]
    flags: Dict[str, bool]
    encode: N.Function
    decode: N.Function
    sections: List[Section]
    encode_length: str
    decode_length: str
    input_elem: T.Scalar
    output_elem: T.Scalar
    static_decls: List[N.Decl]


class _Scope:
    def __init__(self, parent: Optional[_Scope] = None, is_lambda: bool = False) -> None:
        self.parent = parent
        self.names: Dict[str, Sym] = {}
        self.is_lambda = is_lambda

    def lookup(self, name: str) -> Optional[Sym]:
        s: Optional[_Scope] = self
        while s is not None:
            if name in s.names:
                return s.names[name]
            s = s.parent
        return None


class Checker:
    """Checks one spec; use :func:`check`."""

    def __init__(self, spec: N.Spec) -> None:
        self.spec = spec
        self.uids = itertools.count()
        self.flags = {f: False for f in FLAGS}
        self.uses_random = False
        self.fn: Optional[N.Function] = None
        self.length_name = "n"
        self.static_decls: List[N.Decl] = []

    # --------------------------------------------------------------------- helpers
    def error(self, node: Any, msg: str) -> CompLLTypeError:
        """Return a type error located at ``node``."""
        line, col = (node.line, node.col) if node is not None else (0, 0)
        return CompLLTypeError(msg, line, col, self.spec.path, self.spec.source)

    def new_sym(self, scope: _Scope, node: Any, name: str, kind: str, ty: Any, role: str,
                static: bool = False) -> Sym:
        """Declare ``name`` in ``scope`` (no shadowing of any visible name)."""
        if name in RESERVED:
            raise self.error(node, f"{name!r} is reserved (a builtin); choose another name")
        if scope.lookup(name) is not None:
            raise self.error(node, f"{name!r} is already defined; names cannot be redefined")
        sym = Sym(name, kind, ty, role, static, node, f"u{next(self.uids)}_{name}")
        scope.names[name] = sym
        return sym

    def scalar_type(self, t: N.TypeExpr, what: str) -> T.Scalar:
        """Return the scalar type written as ``t`` (its element type for arrays)."""
        if t.base == "uint":
            if t.bits not in (1, 2, 4, 8):
                raise self.error(t, f"uint<{t.bits}> in {what}: code widths are 1, 2, 4 or 8 "
                                    "bits")
            return T.uint(t.bits)
        if t.base == "uint8":
            return T.UINT8
        return T.Scalar(t.base)

    # ---------------------------------------------------------------------- header
    def check_header(self) -> List[ParamInfo]:
        """Check the codec header: name, flags and parameters."""
        spec = self.spec
        if not _IDENT.fullmatch(spec.name):
            raise self.error(spec, f"codec name {spec.name!r} must be lower case letters, "
                                   "digits and '_', starting with a letter")
        seen = set()
        for f in spec.flags:
            if f.name == "summable":
                raise self.error(f, "'summable' is not supported by CompLL: generated codecs "
                                    "have no reduce_stages; remove the flag")
            if f.name not in FLAGS:
                raise self.error(f, f"unknown flag {f.name!r}; valid flags: {', '.join(FLAGS)}")
            if f.name in seen:
                raise self.error(f, f"flag {f.name!r} given twice")
            seen.add(f.name)
            self.flags[f.name] = True
        params = []
        self.globals = _Scope()
        for name, value in CONSTANTS.items():
            self.globals.names[name] = Sym(name, "scalar", T.FLOAT, "const", True, value, name)
        for p in spec.params:
            if p.type.is_array:
                raise self.error(p.type, "parameters are scalars (float, double, int, long or "
                                         "bool)")
            ty = self.scalar_type(p.type, "a parameter")
            if ty.kind == "uint":
                raise self.error(p.type, "parameters are float, double, int, long or bool")
            default = self.literal(p.default, ty, f"default of {p.name!r}")
            info = ParamInfo(p.name, ty, default, lo_closed=p.lo_closed, hi_closed=p.hi_closed)
            if p.lo is not None:
                if ty.kind == "bool":
                    raise self.error(p.lo, "a bool parameter cannot have a range")
                info.lo = self.literal(p.lo, T.DOUBLE, "range bound")
                info.hi = self.literal(p.hi, T.DOUBLE, "range bound")
                if math.isinf(info.lo):
                    info.lo = None
                if math.isinf(info.hi):
                    info.hi = None
                if not in_range(info, default):
                    raise self.error(p.default, f"default {default!r} of {p.name!r} is outside "
                                                f"its range {info.describe_range()}")
            self.new_sym(self.globals, p, p.name, "scalar", ty, "param", static=True)
            params.append(info)
        return params

    def literal(self, e: N.Expr, ty: T.Scalar, what: str) -> Any:
        """Return the value of a literal (``1``, ``-0.5``, ``inf``, ``true``) of type ``ty``."""
        sign = 1
        node = e
        if isinstance(e, N.Unary) and e.op == "-":
            sign, node = -1, e.expr
        if isinstance(node, N.BoolLit) and sign == 1:
            if ty.kind != "bool":
                raise self.error(e, f"{what} must be a {ty}, got a bool")
            return node.value
        if isinstance(node, N.Name) and node.id == "inf":
            if not ty.is_float:
                raise self.error(e, f"{what} must be a {ty}, got inf")
            return sign * math.inf
        if isinstance(node, N.Num):
            if ty.kind == "bool":
                raise self.error(e, f"{what} must be true or false")
            if node.is_float and not ty.is_float:
                raise self.error(e, f"{what} must be an integer ({ty}), got {node.value}")
            return sign * (float(node.value) if ty.is_float else int(node.value))
        raise self.error(e, f"{what} must be a literal number")

    # ------------------------------------------------------------------- functions
    def check_spec(self) -> SpecInfo:
        """Check the whole spec; return what the generators need."""
        params = self.check_header()
        fns: Dict[str, N.Function] = {}
        for fn in self.spec.functions:
            if fn.name not in ("encode", "decode"):
                raise self.error(fn, f"unknown function {fn.name!r}; a spec defines exactly "
                                     "'encode' and 'decode'")
            if fn.name in fns:
                raise self.error(fn, f"function {fn.name!r} defined twice")
            fns[fn.name] = fn
        for missing in ("encode", "decode"):
            if missing not in fns:
                raise self.error(self.spec, f"the spec has no {missing!r} function")
        sections, enc_len, in_elem = self.check_encode(fns["encode"])
        if sections and any(s.length.dynamic for s in sections) != self.flags["variable_size"]:
            if self.flags["variable_size"]:
                raise self.error(self.spec, "the codec is declared 'variable_size' but every "
                                            "section has a fixed length; remove the flag")
            sec = next(s for s in sections if s.length.dynamic)
            raise self.error(sec.expr, "this section's length depends on the data; declare "
                                       "'variable_size;' in the codec header")
        if self.uses_random != self.flags["stochastic"]:
            if self.uses_random:
                raise self.error(self.spec, "encode draws random numbers; declare 'stochastic;' "
                                            "in the codec header")
            raise self.error(self.spec, "the codec is declared 'stochastic' but never calls "
                                        "random or randint; remove the flag")
        dec_len, out_elem = self.check_decode(fns["decode"], sections)
        return SpecInfo(self.spec, self.spec.name, f"compll.{self.spec.name}", params,
                        dict(self.flags), fns["encode"], fns["decode"], sections, enc_len,
                        dec_len, in_elem, out_elem, self.static_decls)

    def bind_length(self, scope: _Scope, t: N.TypeExpr, what: str) -> str:
        """Declare the gradient-length name written in ``float[n]``."""
        if not isinstance(t.length, N.Name):
            raise self.error(t, f"{what} must name the gradient length, e.g. float[n]")
        name = t.length.id
        self.new_sym(scope, t.length, name, "scalar", T.LONG, "length", static=True)
        return name

    def check_encode(self, fn: N.Function) -> Tuple[List[Section], str, T.Scalar]:
        """Check encode; return its payload sections, length name and input type."""
        self.fn = fn
        scope = _Scope(self.globals)
        if not (fn.ret.is_array and fn.ret.base == "uint8" and fn.ret.length is None):
            raise self.error(fn.ret, "encode returns the payload: declare it 'uint8[] encode(...)'")
        if len(fn.params) != 1:
            raise self.error(fn, "encode takes one argument, the gradient: encode(float[n] g)")
        pt, pname = fn.params[0]
        elem = self.scalar_type(pt, "encode's argument")
        if not pt.is_array or not elem.is_float:
            raise self.error(pt, "encode's argument is the gradient: float[n] g or double[n] g")
        self.length_name = self.bind_length(scope, pt, "encode's argument")
        length_ref = N.Name(pt.line, pt.col, self.length_name)
        self.expr(length_ref, scope)
        self.new_sym(scope, fn, pname, "array", T.Array(elem, self.static_length(length_ref,
                                                                                  scope)), "input")
        sections = None
        for i, st in enumerate(fn.body):
            if isinstance(st, N.Return):
                if i != len(fn.body) - 1:
                    raise self.error(fn.body[i + 1], "statements after return are unreachable")
                e = st.expr
                if not (isinstance(e, N.Call) and e.fn == "concat"):
                    raise self.error(e, "encode must end with 'return concat(...);' building "
                                        "the payload")
                sections = self.check_concat(e, scope)
            else:
                self.check_stmt(st, scope, in_decode=False)
        if sections is None:
            raise self.error(fn, "encode must end with 'return concat(...);'")
        return sections, self.length_name, elem

    def check_decode(self, fn: N.Function, sections: List[Section]) -> Tuple[str, T.Scalar]:
        """Check decode against encode's sections; return its length name and type."""
        self.fn = fn
        scope = _Scope(self.globals)
        if not (fn.ret.is_array and fn.ret.base in ("float", "double")):
            raise self.error(fn.ret, "decode returns the gradient: declare 'float[n] decode(...)'")
        length = self.bind_length(scope, fn.ret, "decode's result")
        if length != self.length_name:
            raise self.error(fn.ret.length, f"decode's result must have encode's length "
                                            f"{self.length_name!r}, not {length!r}")
        out_elem = self.scalar_type(fn.ret, "decode's result")
        if len(fn.params) != 1 or not (fn.params[0][0].is_array and fn.params[0][0].base == "uint8"
                                       and fn.params[0][0].length is None):
            raise self.error(fn, "decode takes one argument, the payload: decode(uint8[] payload)")
        self.payload_sym = self.new_sym(scope, fn, fn.params[0][1], "payload", T.PAYLOAD, "input")
        self.sections = sections
        self.extracted = False
        returned = False
        for i, st in enumerate(fn.body):
            if isinstance(st, N.Return):
                if i != len(fn.body) - 1:
                    raise self.error(fn.body[i + 1], "statements after return are unreachable")
                t = self.expr(st.expr, scope)
                if not isinstance(t, T.Array) or not t.elem.is_float:
                    raise self.error(st.expr, f"decode must return a float array, got {t}")
                if t.length.key != self.length_name:
                    raise self.error(st.expr, f"decode must return {self.length_name} elements; "
                                              f"this array has length {t.length.key}")
                returned = True
            else:
                self.check_stmt(st, scope, in_decode=True)
        if not returned:
            raise self.error(fn, "decode must end with 'return <array of n floats>;'")
        if not self.extracted:
            raise self.error(fn, "decode never reads the payload: '(...) = extract(payload);'")
        return length, out_elem

    # ------------------------------------------------------------------ statements
    def check_stmt(self, st: N.Stmt, scope: _Scope, in_decode: bool) -> None:
        """Check one statement of encode or decode."""
        if isinstance(st, N.Decl):
            t = self.expr(st.expr, scope)
            declared = self.declared_type(st.type, scope, t, st.expr)
            if isinstance(declared, T.Scalar):
                self.check_assign(declared, st.expr, f"{st.name!r}")
                sym = self.new_sym(scope, st, st.name, "scalar", declared, "local",
                                   static=st.expr.static)
                if sym.static and not in_decode:
                    self.static_decls.append(st)
            else:
                sym = self.new_sym(scope, st, st.name, "array", declared, "local")
            st.sym = sym
        elif isinstance(st, N.LambdaDecl):
            lt = self.check_lambda(st.fn, scope)
            st.sym = self.new_sym(scope, st, st.name, "lambda", lt, "local")
            st.sym.node = st.fn
        elif isinstance(st, N.CheckFinite):
            for a in st.args:
                t = self.expr(a, scope)
                if not isinstance(t, T.Scalar) or not t.is_float:
                    raise self.error(a, f"check_finite takes float or double scalars, got "
                                        f"{_what(t)}")
        elif isinstance(st, N.Unpack):
            e = st.expr
            if not (isinstance(e, N.Call) and e.fn == "extract"):
                raise self.error(e, "only extract(payload) can be unpacked into several values")
            if not in_decode:
                raise self.error(e, "extract reads a payload; it is used in decode")
            self.check_extract(st, scope)
        else:  # pragma: no cover - the grammar has no other statements
            raise self.error(st, "unsupported statement")

    def declared_type(self, t: N.TypeExpr, scope: _Scope, value: Any, expr: N.Expr) -> Any:
        """Return the declared type of a declaration after checking the value fits it."""
        elem = self.scalar_type(t, "a declaration")
        if not t.is_array:
            if not isinstance(value, T.Scalar):
                raise self.error(expr, f"cannot store {_what(value)} in scalar {elem}")
            return elem
        if not isinstance(value, T.Array):
            raise self.error(expr, f"cannot store {_what(value)} in array {t.text()}")
        if value.elem != elem:
            if value.elem.is_float and not elem.is_float:
                raise self.error(expr, self.narrow_message(elem, value.elem, "array element"))
            raise self.error(expr, f"the array holds {value.elem}, declared {elem}; produce "
                                   f"{elem} elements with map(a, [](...) -> {elem} {{ ... }})")
        if t.length is not None:
            want = self.length_of(t.length, scope)
            if want.key != value.length.key:
                raise self.error(t.length, f"declared length {want.key} but the value has length "
                                           f"{value.length.key}")
        return value

    def check_assign(self, target: T.Scalar, e: N.Expr, what: str) -> None:
        """Raise unless the value of ``e`` may be stored in ``target`` (rule 2)."""
        src = e.ty
        if not isinstance(src, T.Scalar):
            raise self.error(e, f"cannot store {_what(src)} in {what} of type {target}")
        if target == src:
            return
        if target.kind == "bool":
            raise self.error(e, f"cannot store {src} in bool {what}; write a comparison "
                                "(x != 0)")
        if target.is_float:
            if src.kind == "bool":
                raise self.error(e, f"cannot store bool in {target} {what}; write c ? 1.0 : 0.0")
            return
        if src.is_float:
            raise self.error(e, self.narrow_message(target, src, what))
        if target.kind == "uint":
            if src.kind == "bool" or (src.kind == "uint" and src.bits <= target.bits):
                return
            if e.const_range is not None:
                lo, hi = e.const_range
                if 0 <= lo and hi <= target.max_value:
                    return
                raise self.error(e, f"value {hi if hi > target.max_value else lo} does not fit "
                                    f"in {target} {what} (0..{target.max_value})")
            raise self.error(e, f"{src} may not fit in {target} {what}; cast explicitly: "
                                f"{target}(x) keeps the low {target.bits} bits")
        # int or long from bool/uint/int/long: allowed (C-like)

    @staticmethod
    def narrow_message(target: T.Scalar, src: T.Scalar, what: str) -> str:
        """Return the message for a lossy store of ``src`` into ``target``."""
        if target.kind == "uint":
            return (f"cannot store {src} in {target} {what}: codes are unsigned integers; "
                    f"produce them with comparisons (v < 0 ? 1 : 0) or {target}(int(x))")
        return (f"cannot store {src} in {target} {what} without a cast; write {target}(x) "
                "(truncates toward zero)")

    # ---------------------------------------------------------------------- lambdas
    def check_lambda(self, lam: N.Lambda, scope: _Scope) -> T.LambdaType:
        """Check a lambda (parameters, locals, result) and return its type."""
        if scope.is_lambda:
            raise self.error(lam, "lambdas cannot be nested")
        inner = _Scope(scope, is_lambda=True)
        ptypes = []
        for t, name in lam.params:
            if t.is_array:
                raise self.error(t, "lambda parameters are scalars (one element at a time)")
            ty = self.scalar_type(t, "a lambda parameter")
            self.new_sym(inner, t, name, "scalar", ty, "lparam")
            ptypes.append(ty)
        for loc in lam.locals:
            if loc.type.is_array:
                raise self.error(loc.type, "lambda locals are scalars")
            ty = self.scalar_type(loc.type, "a lambda local")
            self.expr(loc.expr, inner)
            self.check_assign(ty, loc.expr, f"local {loc.name!r}")
            loc.sym = self.new_sym(inner, loc, loc.name, "scalar", ty, "llocal")
        if lam.ret.is_array:
            raise self.error(lam.ret, "a lambda returns one scalar per element")
        ret = self.scalar_type(lam.ret, "a lambda result")
        self.expr(lam.result, inner)
        self.check_assign(ret, lam.result, "lambda result")
        lam.ty = T.LambdaType(tuple(ptypes), ret)
        return lam.ty

    def lambda_arg(self, e: N.Expr, scope: _Scope, elems: List[T.Scalar], what: str) -> N.Lambda:
        """Resolve the function argument of map/filter to a Lambda taking ``elems``."""
        if isinstance(e, N.Lambda):
            lam = e
            self.check_lambda(lam, scope)
        elif isinstance(e, N.Name) and e.id in SCALAR_FUNCS:
            params = [(N.TypeExpr(e.line, e.col, t.kind, t.bits, False, None), f"_a{i}")
                      for i, t in enumerate(elems)]
            body = N.Call(e.line, e.col, e.id, [N.Name(e.line, e.col, p) for _, p in params])
            probe = _Scope(scope, is_lambda=True)
            for (_, pn), t in zip(params, elems):
                probe.names[pn] = Sym(pn, "scalar", t, "lparam", False, None, pn)
            rt = self.expr(body, probe)
            ret = N.TypeExpr(e.line, e.col, rt.kind, rt.bits, False, None)
            lam = N.Lambda(e.line, e.col, params, ret, [], body)
            self.check_lambda(lam, scope)
        elif isinstance(e, N.Name):
            sym = scope.lookup(e.id)
            if sym is None or sym.kind != "lambda":
                raise self.error(e, f"{what} needs a lambda; {e.id!r} is "
                                    f"{'undefined' if sym is None else 'not a lambda'}")
            lam = sym.node
            e.sym = sym
        else:
            raise self.error(e, f"{what} needs a lambda, e.g. "
                                "[&](float v) -> float {{ return v; }}")
        lt: T.LambdaType = lam.ty
        if len(lt.params) != len(elems):
            raise self.error(e, f"{what} passes {len(elems)} element(s) per call but the lambda "
                                f"takes {len(lt.params)}")
        for i, (want, got) in enumerate(zip(lt.params, elems)):
            if want != got and not _widens(got, want):
                raise self.error(e, f"lambda parameter {i + 1} is {want} but the array holds "
                                    f"{got}")
        return lam

    # ------------------------------------------------------------------ expressions
    def expr(self, e: N.Expr, scope: _Scope) -> Any:
        """Type ``e`` in ``scope``; set ``e.ty``, ``e.static`` and ``e.const_range``."""
        method = getattr(self, "_e_" + type(e).__name__)
        e.ty = method(e, scope)
        return e.ty

    def _e_Num(self, e: N.Num, scope: _Scope) -> T.Scalar:
        e.static = True
        e.weak = True
        if e.is_float:
            return T.FLOAT
        if e.value >= 2**63:
            raise self.error(e, f"integer literal {e.value} does not fit in a long")
        e.const_range = (e.value, e.value)
        return T.LONG if e.value >= 2**31 else T.INT

    def _e_BoolLit(self, e: N.BoolLit, scope: _Scope) -> T.Scalar:
        e.static = True
        e.const_range = (int(e.value), int(e.value))
        return T.BOOL

    def _e_OpRef(self, e: N.OpRef, scope: _Scope) -> Any:
        raise self.error(e, f"operator {e.op!r} can only be passed to reduce")

    def _e_Lambda(self, e: N.Lambda, scope: _Scope) -> Any:
        raise self.error(e, "a lambda can only be passed to map or filter, or named with "
                            "'lambda f = ...;'")

    def _e_Name(self, e: N.Name, scope: _Scope) -> Any:
        sym = scope.lookup(e.id)
        if sym is None:
            if e.id in ARRAY_OPS or e.id in SCALAR_FUNCS:
                raise self.error(e, f"{e.id!r} is a function; call it: {e.id}(...)")
            raise self.error(e, f"undefined name {e.id!r}")
        if scope.is_lambda and sym.kind == "array":
            raise self.error(e, f"lambdas work on one element at a time; the array {e.id!r} "
                                "cannot be used whole inside a lambda (index it: a[0])")
        if sym.kind == "lambda":
            raise self.error(e, f"{e.id!r} is a lambda; pass it to map or filter")
        if sym.kind == "payload" and not getattr(self, "_allow_payload", False):
            raise self.error(e, f"the payload {e.id!r} is read with extract({e.id})")
        e.sym = sym
        e.static = sym.static
        return sym.ty

    def _e_Unary(self, e: N.Unary, scope: _Scope) -> T.Scalar:
        t = self.scalar_operand(e.expr, scope, e.op)
        e.static = e.expr.static
        e.weak = getattr(e.expr, "weak", False)
        if e.op == "!":
            if t.is_float:
                raise self.error(e.expr, "'!' needs a bool or an integer")
            return T.BOOL
        if not t.is_numeric:
            raise self.error(e.expr, "cannot negate a bool")
        if e.expr.const_range is not None:
            lo, hi = e.expr.const_range
            e.const_range = (-hi, -lo)
        return T.promote(t, T.INT) if t.rank < T.INT.rank else t

    def scalar_operand(self, e: N.Expr, scope: _Scope, op: str) -> T.Scalar:
        """Type ``e`` and require a scalar (an operand of ``op``)."""
        t = self.expr(e, scope)
        if not isinstance(t, T.Scalar):
            raise self.error(e, f"operator {op!r} works on scalars, not {_what(t)}; use map")
        return t

    def _e_Binary(self, e: N.Binary, scope: _Scope) -> T.Scalar:
        a = self.scalar_operand(e.left, scope, e.op)
        b = self.scalar_operand(e.right, scope, e.op)
        e.static = e.left.static and e.right.static
        wa, wb = getattr(e.left, "weak", False), getattr(e.right, "weak", False)
        e.weak = wa and wb
        if e.op in ("&&", "||"):
            for side, t in ((e.left, a), (e.right, b)):
                if t.is_float:
                    raise self.error(side, f"{e.op!r} needs bools (or integers), got {t}")
            return T.BOOL
        if e.op in ("==", "!=") and a.kind == "bool" and b.kind == "bool":
            return T.BOOL
        for side, t in ((e.left, a), (e.right, b)):
            if t.kind == "bool" and e.op not in ("==", "!="):
                raise self.error(side, f"operator {e.op!r} does not take a bool; convert with "
                                       "c ? 1 : 0")
        t = weak_promote(a, wa, b, wb)
        e.operand_ty = t
        if e.op == "%" and t.is_float:
            raise self.error(e, "'%' works on integers only")
        if e.op in ("<", "<=", ">", ">=", "==", "!="):
            return T.BOOL
        return t

    def _e_Cond(self, e: N.Cond, scope: _Scope) -> Any:
        c = self.expr(e.cond, scope)
        if not isinstance(c, T.Scalar) or c.is_float:
            raise self.error(e.cond, f"a condition must be a bool (or an integer), got {c}")
        a = self.expr(e.then, scope)
        b = self.expr(e.other, scope)
        e.static = e.cond.static and e.then.static and e.other.static
        if isinstance(a, T.Array) or isinstance(b, T.Array):
            if scope.is_lambda:
                raise self.error(e, "array values cannot be chosen inside a lambda")
            if not (isinstance(a, T.Array) and isinstance(b, T.Array) and a.elem == b.elem):
                raise self.error(e, f"both sides of '?:' must have the same type, got {a} and {b}")
            if a.length.key == b.length.key:
                return a
            return T.Array(a.elem, T.Length(f"dyn{next(self.uids)}", None, None))
        if not (isinstance(a, T.Scalar) and isinstance(b, T.Scalar)):
            raise self.error(e, f"'?:' chooses between scalars or arrays, got {a} and {b}")
        wa, wb = getattr(e.then, "weak", False), getattr(e.other, "weak", False)
        e.weak = wa and wb
        if e.then.const_range and e.other.const_range:
            e.const_range = (min(e.then.const_range[0], e.other.const_range[0]),
                             max(e.then.const_range[1], e.other.const_range[1]))
        if a == b:
            return a
        if a.kind == "bool" or b.kind == "bool":
            if e.const_range is not None:
                return T.INT
            raise self.error(e, f"both sides of '?:' must be bools, got {a} and {b}")
        if a.kind == "uint" and b.kind == "uint":
            return T.uint(max(a.bits, b.bits))
        return weak_promote(a, wa, b, wb)

    def _e_Index(self, e: N.Index, scope: _Scope) -> T.Scalar:
        if not isinstance(e.array, N.Name):
            raise self.error(e.array, "only named arrays can be indexed")
        saved = scope.is_lambda
        sym = scope.lookup(e.array.id)
        if sym is not None and sym.kind == "array":
            e.array.sym = sym
            e.array.ty = sym.ty
        else:
            self.expr(e.array, scope)
        arr = e.array.ty
        if not isinstance(arr, T.Array):
            raise self.error(e.array, f"{e.array.id!r} is not an array")
        i = self.expr(e.index, scope)
        if not isinstance(i, T.Scalar) or not (i.is_integer or i.kind == "bool"):
            raise self.error(e.index, f"an index must be an integer, got {i}")
        if saved and _uses_lambda_vars(e.index):
            raise self.error(e.index, "inside a lambda, arrays can be indexed only by values "
                                      "that do not depend on the element (e.g. a[0])")
        e.static = False
        return arr.elem

    def _e_ArrayLit(self, e: N.ArrayLit, scope: _Scope) -> T.Array:
        if scope.is_lambda:
            raise self.error(e, "array literals cannot appear inside a lambda")
        types = [self.expr(it, scope) for it in e.items]
        for it, t in zip(e.items, types):
            if not isinstance(t, T.Scalar) or t.kind == "bool" or t.packed:
                raise self.error(it, f"array literal items are numbers, got {t}")
        elem = types[0]
        weak = getattr(e.items[0], "weak", False)
        for it, t in zip(e.items[1:], types[1:]):
            elem = weak_promote(elem, weak, t, getattr(it, "weak", False))
            weak = weak and getattr(it, "weak", False)
        e.static = all(it.static for it in e.items)
        k = len(e.items)
        return T.Array(elem, T.Length(str(k), _num(e, k)))

    def _e_Cast(self, e: N.Cast, scope: _Scope) -> T.Scalar:
        to = self.scalar_type(e.to, "a cast")
        t = self.scalar_operand(e.expr, scope, f"{to}(...)")
        e.static = e.expr.static
        if to.kind == "uint" and t.is_float:
            raise self.error(e.expr, f"cannot cast {t} to {to} directly; codes come from integers: "
                                     f"{to}(int(x))")
        if to.kind == "bool":
            raise self.error(e, "cast to bool is not allowed; write a comparison (x != 0)")
        return to

    # ------------------------------------------------------------------------ calls
    def _e_Call(self, e: N.Call, scope: _Scope) -> Any:
        if e.fn in SCALAR_FUNCS:
            return self.scalar_call(e, scope)
        if e.fn not in ARRAY_OPS:
            sym = scope.lookup(e.fn)
            if sym is not None and sym.kind == "lambda":
                raise self.error(e, f"lambdas are applied through map: map(a, {e.fn})")
            raise self.error(e, f"unknown function {e.fn!r}; operators: {', '.join(ARRAY_OPS)}; "
                                f"scalar functions: {', '.join(SCALAR_FUNCS)}")
        if scope.is_lambda:
            raise self.error(e, f"array operator {e.fn!r} cannot be used inside a lambda")
        if e.fn in ("concat",):
            raise self.error(e, "concat builds the payload: use it as 'return concat(...);' in "
                                "encode")
        if e.fn == "extract":
            raise self.error(e, "extract is unpacked: (float a, uint<1>[n] b) = extract(payload);")
        return getattr(self, "_op_" + e.fn)(e, scope)

    def nargs(self, e: N.Call, lo: int, hi: Optional[int] = None, sig: str = "") -> None:
        """Require between ``lo`` and ``hi`` arguments; ``sig`` explains the call."""
        hi = lo if hi is None else hi
        if not lo <= len(e.args) <= hi:
            raise self.error(e, f"{e.fn} takes {sig}")

    def array_arg(self, e: N.Expr, scope: _Scope, what: str) -> T.Array:
        """Type ``e`` and require an array."""
        t = self.expr(e, scope)
        if not isinstance(t, T.Array):
            raise self.error(e, f"{what} must be an array, got {_what(t)}")
        return t

    def int_arg(self, e: N.Expr, scope: _Scope, what: str) -> T.Scalar:
        """Type ``e`` and require an integer scalar."""
        t = self.expr(e, scope)
        if not isinstance(t, T.Scalar) or not t.is_integer:
            raise self.error(e, f"{what} must be an integer, got {_what(t)}")
        return t

    def scalar_call(self, e: N.Call, scope: _Scope) -> T.Scalar:
        """Type a scalar function call (abs, sqrt, floor, ceil, rint, min, max)."""
        if e.fn in ("min", "max"):
            if len(e.args) == 2:
                a = self.scalar_operand(e.args[0], scope, e.fn)
                b = self.scalar_operand(e.args[1], scope, e.fn)
                if a.kind == "bool" or b.kind == "bool":
                    raise self.error(e, f"{e.fn} of bools is not defined")
                e.static = e.args[0].static and e.args[1].static
                wa, wb = getattr(e.args[0], "weak", False), getattr(e.args[1], "weak", False)
                e.weak = wa and wb
                t = weak_promote(a, wa, b, wb)
                e.operand_ty = t
                return t
            raise self.error(e, f"{e.fn}(a, b) takes two scalars; the largest element of an "
                                f"array is reduce(a, {e.fn})")
        self.nargs(e, 1, sig=f"one scalar: {e.fn}(x)")
        t = self.scalar_operand(e.args[0], scope, e.fn)
        e.static = e.args[0].static
        if e.fn == "abs":
            if t.kind == "bool":
                raise self.error(e.args[0], "abs of a bool is not defined")
            return T.promote(t, T.INT) if t.rank < T.INT.rank else t
        if not t.is_float:
            raise self.error(e.args[0], f"{e.fn} needs a float or double, got {t}; convert "
                                        "with float(x)")
        return t

    def static_length(self, e: N.Expr, scope: _Scope) -> T.Length:
        """Return the Length of a static length expression."""
        return T.Length(length_key(e), e)

    def length_of(self, e: N.Expr, scope: _Scope, bound: Any = None) -> T.Length:
        """Return the Length of an array whose length is the scalar expression ``e``."""
        t = self.expr(e, scope)
        if not isinstance(t, T.Scalar) or not (t.is_integer):
            raise self.error(e, f"a length must be an integer, got {_what(t)}")
        if e.static:
            return T.Length(length_key(e), e)
        return T.Length(f"dyn{next(self.uids)}", None, bound)

    def _op_len(self, e: N.Call, scope: _Scope) -> T.Scalar:
        self.nargs(e, 1, sig="one array: len(a)")
        a = self.array_arg(e.args[0], scope, "len's argument")
        e.static = not a.length.dynamic
        return T.LONG

    def _op_map(self, e: N.Call, scope: _Scope) -> T.Array:
        if len(e.args) < 2:
            raise self.error(e, "map takes arrays and a lambda: map(a, f) or map(a, b, f)")
        arrays = [self.array_arg(a, scope, "map's argument") for a in e.args[:-1]]
        self.same_lengths(e, arrays, "map")
        lam = self.lambda_arg(e.args[-1], scope, [a.elem for a in arrays], "map")
        e.lam = lam
        return T.Array(lam.ty.ret, arrays[0].length)

    def same_lengths(self, e: N.Call, arrays: List[T.Array], what: str) -> None:
        """Require arrays of one length (map and filter work elementwise)."""
        for i, a in enumerate(arrays[1:], 1):
            if a.length.key != arrays[0].length.key:
                raise self.error(e.args[i], f"{what} needs arrays of one length; argument 1 has "
                                            f"length {arrays[0].length.key}, argument {i + 1} "
                                            f"has {a.length.key}")

    def _op_filter(self, e: N.Call, scope: _Scope) -> T.Array:
        if len(e.args) < 2:
            raise self.error(e, "filter takes arrays and a predicate: filter(a, [&](float v) -> "
                                "bool { ... })")
        arrays = [self.array_arg(a, scope, "filter's argument") for a in e.args[:-1]]
        self.same_lengths(e, arrays, "filter")
        lam = self.lambda_arg(e.args[-1], scope, [a.elem for a in arrays], "filter")
        if lam.ty.ret.kind != "bool":
            raise self.error(e.args[-1], f"filter's predicate must return bool, not {lam.ty.ret}")
        e.lam = lam
        ln = arrays[0].length
        bound = ln.expr if ln.expr is not None else ln.bound
        return T.Array(T.INT, T.Length(f"dyn{next(self.uids)}", None, bound))

    def _op_reduce(self, e: N.Call, scope: _Scope) -> T.Scalar:
        self.nargs(e, 2, sig="an array and an operator: reduce(a, +), reduce(a, max)")
        a = self.array_arg(e.args[0], scope, "reduce's argument")
        op = e.args[1]
        if isinstance(op, N.OpRef) and op.op == "+":
            e.reduce_op = "+"
        elif isinstance(op, N.Name) and op.id in ("max", "min"):
            e.reduce_op = op.id
        else:
            raise self.error(op, "reduce's operator is +, max or min")
        if a.elem.packed and e.reduce_op != "+":
            pass
        if e.reduce_op == "+":
            return a.elem if a.elem.is_float else T.LONG
        return a.elem if a.elem.rank >= T.INT.rank else T.INT

    def _op_gather(self, e: N.Call, scope: _Scope) -> T.Array:
        self.nargs(e, 2, sig="an array and indices: gather(a, idx)")
        a = self.array_arg(e.args[0], scope, "gather's first argument")
        idx = self.array_arg(e.args[1], scope, "gather's indices")
        if not idx.elem.is_integer or idx.elem.kind == "uint":
            raise self.error(e.args[1], f"gather's indices must be int or long, got {idx.elem}")
        return T.Array(a.elem, idx.length)

    def _op_scatter(self, e: N.Call, scope: _Scope) -> T.Array:
        self.nargs(e, 3, sig="indices, values and a length: scatter(idx, vals, n)")
        idx = self.array_arg(e.args[0], scope, "scatter's indices")
        vals = self.array_arg(e.args[1], scope, "scatter's values")
        if not idx.elem.is_integer or idx.elem.kind == "uint":
            raise self.error(e.args[0], f"scatter's indices must be int or long, got {idx.elem}")
        if vals.elem.packed or vals.elem.kind == "bool":
            raise self.error(e.args[1], "scatter's values must be numbers")
        if idx.length.key != vals.length.key:
            raise self.error(e.args[1], f"scatter needs as many values as indices; got lengths "
                                        f"{idx.length.key} and {vals.length.key}")
        return T.Array(vals.elem, self.length_of(e.args[2], scope))

    def _op_sort(self, e: N.Call, scope: _Scope) -> T.Array:
        self.nargs(e, 1, sig="one array: sort(a)")
        a = self.array_arg(e.args[0], scope, "sort's argument")
        if a.elem.packed or a.elem.kind == "bool":
            raise self.error(e.args[0], "sort works on numbers")
        return a

    def _op_topk(self, e: N.Call, scope: _Scope) -> T.Array:
        self.nargs(e, 2, sig="an array and k: topk(a, k) (indices of the k largest)")
        a = self.array_arg(e.args[0], scope, "topk's argument")
        self.int_arg(e.args[1], scope, "k")
        if a.elem.packed or a.elem.kind == "bool":
            raise self.error(e.args[0], "topk works on numbers")
        bound = a.length.expr if a.length.expr is not None else a.length.bound
        return T.Array(T.INT, self.length_of(e.args[1], scope, bound))

    def _op_kth(self, e: N.Call, scope: _Scope) -> T.Scalar:
        self.nargs(e, 2, sig="an array and k: kth(a, k) (the k-th largest element)")
        a = self.array_arg(e.args[0], scope, "kth's argument")
        self.int_arg(e.args[1], scope, "k")
        if a.elem.packed or a.elem.kind == "bool":
            raise self.error(e.args[0], "kth works on numbers")
        return a.elem

    def _op_first(self, e: N.Call, scope: _Scope) -> T.Array:
        self.nargs(e, 2, sig="an array and a count: first(a, m) (at most m leading elements)")
        a = self.array_arg(e.args[0], scope, "first's argument")
        self.int_arg(e.args[1], scope, "first's count")
        if e.args[1].static:
            return T.Array(a.elem, T.Length(f"dyn{next(self.uids)}", None, e.args[1]))
        bound = a.length.expr if a.length.expr is not None else a.length.bound
        return T.Array(a.elem, T.Length(f"dyn{next(self.uids)}", None, bound))

    def _op_random(self, e: N.Call, scope: _Scope) -> T.Array:
        self.nargs(e, 1, sig="a length: random(m) (uniform floats in [0, 1))")
        self.uses_random = True
        return T.Array(T.FLOAT, self.length_of(e.args[0], scope))

    def _op_randint(self, e: N.Call, scope: _Scope) -> T.Array:
        self.nargs(e, 3, sig="bounds and a length: randint(lo, hi, m) (longs in [lo, hi))")
        self.uses_random = True
        self.int_arg(e.args[0], scope, "randint's lower bound")
        self.int_arg(e.args[1], scope, "randint's upper bound")
        return T.Array(T.LONG, self.length_of(e.args[2], scope))

    # ------------------------------------------------------------ concat / extract
    def check_concat(self, e: N.Call, scope: _Scope) -> List[Section]:
        """Check encode's ``concat`` and return the payload sections."""
        if not e.args:
            raise self.error(e, "concat needs at least one section")
        if len(e.args) > 255:
            raise self.error(e, "a payload has at most 255 sections")
        sections = []
        for a in e.args:
            t = self.expr(a, scope)
            if isinstance(t, T.Scalar):
                if t.kind == "bool" or t.packed:
                    raise self.error(a, f"a {t} cannot travel alone; use uint8 or a number")
                sections.append(Section(t, T.Length("1", _num(a, 1)), True, a))
            elif isinstance(t, T.Array):
                if t.elem.kind == "bool":
                    raise self.error(a, "bool arrays cannot travel; map them to uint<1> codes")
                if t.length.dynamic and t.length.bound is None:
                    raise self.error(a, "this section's length has no upper bound computable "
                                        "from n and the parameters")
                sections.append(Section(t.elem, t.length, False, a))
            else:
                raise self.error(a, f"concat takes scalars and arrays, got {_what(t)}")
        e.ty = T.PAYLOAD
        e.sections = sections
        return sections

    def check_extract(self, st: N.Unpack, scope: _Scope) -> None:
        """Check decode's ``extract`` against encode's sections and bind them."""
        e = st.expr
        if self.extracted:
            raise self.error(e, "the payload is extracted once")
        if len(e.args) != 1 or not isinstance(e.args[0], N.Name):
            raise self.error(e, "extract takes the payload: extract(payload)")
        self._allow_payload = True
        try:
            t = self.expr(e.args[0], scope)
        finally:
            self._allow_payload = False
        if t != T.PAYLOAD:
            raise self.error(e.args[0], "extract reads decode's payload argument")
        if len(st.targets) != len(self.sections):
            raise self.error(st, f"encode concatenates {len(self.sections)} sections but "
                                 f"{len(st.targets)} are extracted")
        syms = []
        for i, ((tt, name), sec) in enumerate(zip(st.targets, self.sections)):
            elem = self.scalar_type(tt, "an extracted section")
            if elem != sec.elem:
                raise self.error(tt, f"section {i + 1} holds {sec.elem}, not {elem}")
            if not tt.is_array:
                if not sec.scalar:
                    raise self.error(tt, f"section {i + 1} is an array; declare {elem}[] {name}")
                syms.append(self.new_sym(scope, tt, name, "scalar", elem, "section"))
                continue
            same_as = None
            if (isinstance(tt.length, N.Call) and tt.length.fn == "len" and len(tt.length.args) == 1
                    and isinstance(tt.length.args[0], N.Name)):
                other = scope.lookup(tt.length.args[0].id)
                if other is None or other.role != "section" or other.kind != "array":
                    raise self.error(tt.length, "a section's length may be len(x) of an earlier "
                                                "extracted array x")
                self.expr(tt.length, scope)
                length, same_as = other.ty.length, other
            elif tt.length is not None:
                length = self.length_of(tt.length, scope)
                if length.dynamic:
                    raise self.error(tt.length, "an extracted length must be computable from n "
                                                "and the parameters")
            elif elem.packed:
                raise self.error(tt, f"give the number of {elem} codes: {elem}[n] {name} (the "
                                     "last byte is padded)")
            else:
                length = T.Length(f"sec{i}", None, None)
            sym = self.new_sym(scope, tt, name, "array", T.Array(elem, length), "section")
            sym.same_as = same_as
            syms.append(sym)
        st.syms = syms
        self.extracted = True


# ----------------------------------------------------------------------- utilities
def _num(at: N.Node, k: int) -> N.Num:
    """Return a typed integer literal located at ``at`` (synthetic lengths)."""
    num = N.Num(at.line, at.col, k, False)
    num.ty, num.static, num.weak, num.const_range = T.INT, True, True, (k, k)
    return num


def weak_promote(a: T.Scalar, weak_a: bool, b: T.Scalar, weak_b: bool) -> T.Scalar:
    """Promote, letting a literal side adopt the other side's type (``v * 2`` stays float)."""
    if weak_a and not weak_b and b.is_numeric and (b.is_float or not a.is_float):
        return b if b.rank >= T.INT.rank else T.INT
    if weak_b and not weak_a and a.is_numeric and (a.is_float or not b.is_float):
        return a if a.rank >= T.INT.rank else T.INT
    return T.promote(a, b)


def _widens(src: T.Scalar, dst: T.Scalar) -> bool:
    """Whether every ``src`` value converts to ``dst`` without loss or surprise."""
    if src == dst:
        return True
    if dst.kind == "uint":
        return src.kind == "bool" or (src.kind == "uint" and src.bits <= dst.bits)
    if dst.kind == "bool" or src.is_float and not dst.is_float:
        return False
    return src.rank <= dst.rank


def _what(t: Any) -> str:
    if isinstance(t, T.Array):
        return f"an array ({t})"
    if isinstance(t, T.Scalar):
        return f"a {t}"
    return str(t)


def _uses_lambda_vars(e: N.Expr) -> bool:
    for sub in walk(e):
        sym = getattr(sub, "sym", None)
        if sym is not None and sym.role in ("lparam", "llocal"):
            return True
    return False


def walk(e: Any):
    """Yield ``e`` and every expression below it."""
    yield e
    for f in dataclasses.fields(e) if dataclasses.is_dataclass(e) else ():
        v = getattr(e, f.name)
        if isinstance(v, N.Expr):
            yield from walk(v)
        elif isinstance(v, list):
            for it in v:
                if isinstance(it, N.Expr):
                    yield from walk(it)
                elif isinstance(it, N.LocalDecl):
                    yield from walk(it.expr)


def length_key(e: N.Expr) -> str:
    """Return the canonical text of a static length expression (equal text, equal length)."""
    if isinstance(e, N.Num):
        return str(e.value)
    if isinstance(e, N.Name):
        return e.id
    if isinstance(e, N.Binary):
        return f"({length_key(e.left)}{e.op}{length_key(e.right)})"
    if isinstance(e, N.Unary):
        return f"{e.op}{length_key(e.expr)}"
    if isinstance(e, N.Call):
        if e.fn == "len":
            return e.args[0].ty.length.key
        return f"{e.fn}({','.join(length_key(a) for a in e.args)})"
    if isinstance(e, N.Cast):
        return f"{e.to.text()}({length_key(e.expr)})"
    if isinstance(e, N.Cond):
        return f"({length_key(e.cond)}?{length_key(e.then)}:{length_key(e.other)})"
    return f"<{type(e).__name__}@{e.line}:{e.col}>"


def in_range(p: ParamInfo, v: Any) -> bool:
    """Whether ``v`` lies in the parameter's declared interval."""
    if isinstance(v, bool):
        return True
    if p.lo is not None and (v < p.lo or (v == p.lo and not p.lo_closed)):
        return False
    if p.hi is not None and (v > p.hi or (v == p.hi and not p.hi_closed)):
        return False
    return not (isinstance(v, float) and math.isnan(v))


def check(spec: N.Spec) -> SpecInfo:
    """Type-check a parsed spec.

    Args:
        spec: the tree returned by :func:`hipress.compll.parser.parse`.

    Returns:
        The spec's :class:`SpecInfo` (the tree is annotated in place).

    Raises:
        CompLLTypeError: the first error found, with its line and column.
    """
    return Checker(spec).check_spec()
