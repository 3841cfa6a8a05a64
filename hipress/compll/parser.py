"""Parse CompLL specs (grammar in ``grammar.lark``) into :mod:`hipress.compll.nodes`.

Errors carry the line, the column and what the parser expected there::

    onebit.hpc:7:60: syntax error: unexpected '}', expected ';'
        uint<1>[] neg = map(g, [](float v) -> uint<1> { return v < 0 });
                                                                   ^
"""

from __future__ import annotations

import functools
import os
from typing import Any, List, Optional

import lark
from lark import Token, Transformer, v_args

from hipress.compll import nodes as N
from hipress.compll.errors import CompLLSyntaxError

_GRAMMAR_PATH = os.path.join(os.path.dirname(__file__), "grammar.lark")

#: How terminals that are not plain strings are described to the user.
_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "CAPTURE": "'&'",
    "$END": "end of file",
}


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    with open(_GRAMMAR_PATH, encoding="utf-8") as f:
        grammar = f.read()
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _describe_terminal(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    try:
        term = _parser().get_terminal(name)
    except KeyError:
        return name
    pattern = term.pattern
    if isinstance(pattern, lark.lexer.PatternStr):
        return repr(pattern.value)
    return name.lower()


#: Tokens that continue an expression; when several are possible they read "an operator".
_OPERATORS = {"'!='", "'%'", "'&&'", "'*'", "'+'", "'-'", "'/'", "'<'", "'<='", "'=='", "'>'",
              "'>='", "'?'", "'['", "'||'"}


def _expected_text(expected: List[str]) -> str:
    ops = [e for e in expected if e in _OPERATORS]
    rest = [e for e in expected if e not in _OPERATORS]
    if len(ops) >= 3:
        rest.append("an operator")
    else:
        rest += ops
    return " or ".join(rest)


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    return repr(str(tok))


def parse(source: str, path: str = "<string>") -> N.Spec:
    """Parse the text of a spec.

    Args:
        source: the spec text.
        path: file name used in error messages.

    Returns:
        The syntax tree (untyped; run :func:`hipress.compll.check.check` next).

    Raises:
        CompLLSyntaxError: the text does not follow the grammar; ``line``, ``col`` and
            ``expected`` (the tokens that would have been valid) are set.
    """
    try:
        tree = _parser().parse(source)
    except lark.exceptions.UnexpectedToken as exc:
        expected = sorted({_describe_terminal(t) for t in (exc.accepts or exc.expected)})
        line, col = exc.line, exc.column
        if exc.token.type == "$END":
            lines = source.splitlines() or [""]
            line, col = len(lines), len(lines[-1]) + 1
        raise CompLLSyntaxError(
            f"unexpected {_describe_token(exc.token)}, expected {_expected_text(expected)}",
            line, col, path, source, expected,
        ) from None
    except lark.exceptions.UnexpectedCharacters as exc:
        allowed = sorted({_describe_terminal(t) for t in (exc.allowed or ())})
        hint = f", expected {_expected_text(allowed)}" if allowed else ""
        raise CompLLSyntaxError(
            f"unexpected character {source[exc.pos_in_stream]!r}{hint}",
            exc.line, exc.column, path, source, allowed,
        ) from None
    except lark.exceptions.UnexpectedEOF as exc:  # pragma: no cover - LALR reports tokens
        lines = source.splitlines() or [""]
        raise CompLLSyntaxError(
            "unexpected end of file", len(lines), len(lines[-1]) + 1, path, source,
            sorted({_describe_terminal(t) for t in exc.expected}),
        ) from None
    spec = _ToAst(path, source).transform(tree)
    spec.source = source
    spec.path = path
    return spec


def _pos(meta: Any, children: Optional[List[Any]] = None) -> tuple:
    if getattr(meta, "empty", True) is False or hasattr(meta, "line"):
        try:
            return meta.line, meta.column
        except AttributeError:
            pass
    for c in children or ():
        if isinstance(c, Token):
            return c.line, c.column
        if isinstance(c, N.Node):
            return c.line, c.col
    return 0, 0


_BINARY = {
    "or_": "||", "and_": "&&", "eq_": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">",
    "ge": ">=", "add": "+", "sub": "-", "mul": "*", "div": "/", "mod": "%",
}


@v_args(meta=True)
class _ToAst(Transformer):
    """Turn the lark parse tree into nodes, keeping positions."""

    def __init__(self, path: str, source: str) -> None:
        super().__init__()
        self.path = path
        self.source = source

    # --------------------------------------------------------------------- top level
    def start(self, meta, children):
        header, *functions = children
        name, params, flags, line, col = header
        return N.Spec(line, col, name, params, flags, functions)

    def header(self, meta, children):
        name_tok, *items = children
        params = [i for i in items if isinstance(i, N.Param)]
        flags = [i for i in items if isinstance(i, N.Flag)]
        line, col = _pos(meta, children)
        return (str(name_tok), params, flags, line, col)

    def param_decl(self, meta, children):
        ty, name, default, rng = children
        line, col = _pos(meta, children)
        p = N.Param(line, col, ty, str(name), default)
        if rng is not None:
            p.lo_closed, p.lo, p.hi, p.hi_closed = rng
        return p

    def flag_decl(self, meta, children):
        (name,) = children
        return N.Flag(name.line, name.column, str(name))

    def range_spec(self, meta, children):
        lo_b, lo, hi, hi_b = children
        return (lo_b, lo, hi, hi_b)

    def open_bracket(self, meta, children):
        return False

    def closed_bracket(self, meta, children):
        return True

    def function(self, meta, children):
        ret, name, params, body = children
        return N.Function(ret.line, ret.col, ret, str(name), params or [], body)

    def typed_names(self, meta, children):
        return list(children)

    def typed_name(self, meta, children):
        ty, name = children
        return (ty, str(name))

    def block(self, meta, children):
        return list(children)

    # -------------------------------------------------------------------- statements
    def decl(self, meta, children):
        ty, name, expr = children
        return N.Decl(ty.line, ty.col, ty, str(name), expr)

    def lambda_decl(self, meta, children):
        name, fn = children
        line, col = _pos(meta, children)
        return N.LambdaDecl(line, col, str(name), fn)

    def unpack(self, meta, children):
        *targets, expr = children
        line, col = _pos(meta, children)
        return N.Unpack(line, col, targets, expr)

    def check_finite(self, meta, children):
        line, col = _pos(meta, children)
        return N.CheckFinite(line, col, list(children))

    def ret(self, meta, children):
        (expr,) = children
        line, col = _pos(meta, children)
        return N.Return(line, col, expr)

    # ------------------------------------------------------------------------- types
    def type(self, meta, children):
        (base, bits, line, col), dims = children
        if dims is None:
            return N.TypeExpr(line, col, base, bits, False, None)
        return N.TypeExpr(line, col, base, bits, True, dims[0])

    def dims(self, meta, children):
        return (children[0],)

    def _base(self, meta, name, bits):
        line, col = _pos(meta)
        return (name, bits, line, col)

    def t_float(self, meta, children):
        return self._base(meta, "float", 0)

    def t_double(self, meta, children):
        return self._base(meta, "double", 0)

    def t_int(self, meta, children):
        return self._base(meta, "int", 0)

    def t_long(self, meta, children):
        return self._base(meta, "long", 0)

    def t_uint8(self, meta, children):
        return self._base(meta, "uint8", 8)

    def t_bool(self, meta, children):
        return self._base(meta, "bool", 0)

    def t_uint(self, meta, children):
        (bits,) = children
        return self._base(meta, "uint", int(bits))

    # -------------------------------------------------------------------- expressions
    def lambda_expr(self, meta, children):
        _capture, params, ret, *rest = children
        *locals_, result = rest
        line, col = _pos(meta, children)
        return N.Lambda(line, col, params or [], ret, locals_, result)

    def lambda_local(self, meta, children):
        ty, name, expr = children
        return N.LocalDecl(ty.line, ty.col, ty, str(name), expr)

    def cond(self, meta, children):
        c, a, b = children
        return N.Cond(c.line, c.col, c, a, b)

    def __default__(self, data, children, meta):
        if data in _BINARY:
            left, right = children
            return N.Binary(left.line, left.col, _BINARY[data], left, right)
        return super().__default__(data, children, meta)

    def neg(self, meta, children):
        line, col = _pos(meta, children)
        return N.Unary(line, col, "-", children[0])

    def not_(self, meta, children):
        line, col = _pos(meta, children)
        return N.Unary(line, col, "!", children[0])

    def index(self, meta, children):
        arr, idx = children
        return N.Index(arr.line, arr.col, arr, idx)

    def int_lit(self, meta, children):
        (tok,) = children
        return N.Num(tok.line, tok.column, int(tok), False)

    def float_lit(self, meta, children):
        (tok,) = children
        return N.Num(tok.line, tok.column, float(tok), True)

    def true_lit(self, meta, children):
        line, col = _pos(meta)
        return N.BoolLit(line, col, True)

    def false_lit(self, meta, children):
        line, col = _pos(meta)
        return N.BoolLit(line, col, False)

    def name(self, meta, children):
        (tok,) = children
        return N.Name(tok.line, tok.column, str(tok))

    def call(self, meta, children):
        name, args = children
        return N.Call(name.line, name.column, str(name), args or [])

    def args(self, meta, children):
        return list(children)

    def op_add(self, meta, children):
        line, col = _pos(meta)
        return N.OpRef(line, col, "+")

    def op_mul(self, meta, children):
        line, col = _pos(meta)
        return N.OpRef(line, col, "*")

    def cast(self, meta, children):
        (base, bits, line, col), expr = children
        return N.Cast(line, col, N.TypeExpr(line, col, base, bits, False, None), expr)

    def array_lit(self, meta, children):
        line, col = _pos(meta, children)
        return N.ArrayLit(line, col, list(children))
