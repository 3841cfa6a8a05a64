"""Syntax tree of CompLL specifications.

The parser (:mod:`hipress.compll.parser`) builds these nodes; the type checker
(:mod:`hipress.compll.check`) annotates every expression with its type (``ty``) and
whether its value depends only on the gradient length and the parameters (``static``).
Every node carries the line and column it starts at, for error messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple


@dataclasses.dataclass(eq=False)
class Node:
    """Base of all nodes: source position (1-based line and column)."""

    line: int
    col: int


@dataclasses.dataclass(eq=False)
class TypeExpr(Node):
    """A written type: ``float``, ``uint<2>``, ``int[]``, ``float[n]``.

    Attributes:
        base: one of float, double, int, long, uint8, bool, uint.
        bits: code width of ``uint<bits>`` (8 for uint8, 0 otherwise).
        is_array: the type has brackets.
        length: the length expression inside the brackets, or None for ``[]``.
    """

    base: str
    bits: int
    is_array: bool
    length: Optional[Expr]

    def text(self) -> str:
        """Return the type as written (length shown as ``[...]``)."""
        base = f"uint<{self.bits}>" if self.base == "uint" else self.base
        if not self.is_array:
            return base
        return base + ("[...]" if self.length is not None else "[]")


# ----------------------------------------------------------------------- expressions
@dataclasses.dataclass(eq=False)
class Expr(Node):
    """Base of expressions; ``ty`` and ``static`` are filled in by the type checker."""

    def __post_init__(self) -> None:
        self.ty: Any = None
        self.static: bool = False
        # A literal, or an expression of literals only: adopts the other operand's type.
        self.weak: bool = False
        # Possible values of an integer expression built from literals only (range checks).
        self.const_range: Optional[Tuple[int, int]] = None


@dataclasses.dataclass(eq=False)
class Num(Expr):
    """A numeric literal; ``is_float`` when written with a point or an exponent."""

    value: Any
    is_float: bool


@dataclasses.dataclass(eq=False)
class BoolLit(Expr):
    """``true`` or ``false``."""

    value: bool


@dataclasses.dataclass(eq=False)
class Name(Expr):
    """A reference to a variable, parameter, lambda or builtin."""

    id: str


@dataclasses.dataclass(eq=False)
class OpRef(Expr):
    """A bare operator passed to ``reduce``: ``+`` or ``*``."""

    op: str


@dataclasses.dataclass(eq=False)
class Call(Expr):
    """A call of a builtin operator or function: ``map(g, f)``, ``abs(x)``."""

    fn: str
    args: List[Expr]


@dataclasses.dataclass(eq=False)
class Cast(Expr):
    """An explicit conversion ``float(x)``, ``int(x)``, ``uint<2>(x)``."""

    to: TypeExpr
    expr: Expr


@dataclasses.dataclass(eq=False)
class Unary(Expr):
    """``-x`` or ``!x``."""

    op: str
    expr: Expr


@dataclasses.dataclass(eq=False)
class Binary(Expr):
    """An arithmetic, comparison or logical operation."""

    op: str
    left: Expr
    right: Expr


@dataclasses.dataclass(eq=False)
class Cond(Expr):
    """``c ? a : b``; only the chosen side is evaluated."""

    cond: Expr
    then: Expr
    other: Expr


@dataclasses.dataclass(eq=False)
class Index(Expr):
    """``a[i]``: one element of an array, a scalar."""

    array: Expr
    index: Expr


@dataclasses.dataclass(eq=False)
class ArrayLit(Expr):
    """``{a, b, ...}``: a small array of scalars (a payload section of several values)."""

    items: List[Expr]


@dataclasses.dataclass(eq=False)
class LocalDecl(Node):
    """``type name = expr;`` inside a lambda body."""

    type: TypeExpr
    name: str
    expr: Expr


@dataclasses.dataclass(eq=False)
class Lambda(Expr):
    """``[&](float v) -> uint<1> { ...; return expr; }``: an elementwise function."""

    params: List[Tuple[TypeExpr, str]]
    ret: TypeExpr
    locals: List[LocalDecl]
    result: Expr


# ------------------------------------------------------------------------ statements
@dataclasses.dataclass(eq=False)
class Stmt(Node):
    """Base of statements."""


@dataclasses.dataclass(eq=False)
class Decl(Stmt):
    """``type name = expr;``."""

    type: TypeExpr
    name: str
    expr: Expr


@dataclasses.dataclass(eq=False)
class LambdaDecl(Stmt):
    """``lambda name = [&](...) -> T { ... };``."""

    name: str
    fn: Lambda


@dataclasses.dataclass(eq=False)
class Unpack(Stmt):
    """``(T1 a, T2 b) = extract(payload);``."""

    targets: List[Tuple[TypeExpr, str]]
    expr: Expr


@dataclasses.dataclass(eq=False)
class CheckFinite(Stmt):
    """``check_finite(a, b);``: refuse the gradient if a scalar is NaN or Inf."""

    args: List[Expr]


@dataclasses.dataclass(eq=False)
class Return(Stmt):
    """``return expr;``."""

    expr: Expr


# --------------------------------------------------------------------------- top level
@dataclasses.dataclass(eq=False)
class Param(Node):
    """``param float ratio = 0.01 in (0, 1];``: a constructor parameter of the codec."""

    type: TypeExpr
    name: str
    default: Expr
    lo: Optional[Expr] = None
    hi: Optional[Expr] = None
    lo_closed: bool = True
    hi_closed: bool = True


@dataclasses.dataclass(eq=False)
class Flag(Node):
    """A capability flag in the header: ``error_feedback;``."""

    name: str


@dataclasses.dataclass(eq=False)
class Function(Node):
    """``encode`` or ``decode``."""

    ret: TypeExpr
    name: str
    params: List[Tuple[TypeExpr, str]]
    body: List[Stmt]


@dataclasses.dataclass(eq=False)
class Spec(Node):
    """A whole specification: header (name, parameters, flags) and functions."""

    name: str
    params: List[Param]
    flags: List[Flag]
    functions: List[Function]
    source: str = ""
    path: str = "<string>"
