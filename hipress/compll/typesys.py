"""Types of CompLL: scalars, arrays with symbolic lengths, lambdas and the payload.

Scalars and how they are stored:

============  ==============  ==========================================
type          NumPy dtype     notes
============  ==============  ==========================================
bool          bool            comparison results; not allowed on the wire
uint<b>       uint8           b in 1, 2, 4: codes; arrays are bit-packed
uint8         uint8           the same as uint<8>
int           int32           indices
long          int64           counts, lengths, random integers
float         float32
double        float64
============  ==============  ==========================================

Arrays of ``uint<b>`` with b < 8 are always stored packed, most significant bits first
(the layout of :func:`hipress.codecs.ops.pack_codes`), in kernels and on the wire alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import numpy as np

_RANK = {"bool": 0, "uint": 1, "int": 2, "long": 3, "float": 4, "double": 5}


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A scalar type; ``bits`` is the code width of ``uint`` (8 for uint8)."""

    kind: str
    bits: int = 0

    @property
    def rank(self) -> int:
        """Promotion rank: bool < uint < int < long < float < double."""
        return _RANK[self.kind]

    @property
    def is_float(self) -> bool:
        """Whether the type is float or double."""
        return self.kind in ("float", "double")

    @property
    def is_integer(self) -> bool:
        """Whether the type is uint<b>, uint8, int or long (bool excluded)."""
        return self.kind in ("uint", "int", "long")

    @property
    def is_numeric(self) -> bool:
        """Whether arithmetic applies (bool excluded)."""
        return self.kind != "bool"

    @property
    def packed(self) -> bool:
        """Whether arrays of this type are bit-packed (uint<1>, uint<2>, uint<4>)."""
        return self.kind == "uint" and self.bits < 8

    @property
    def dtype(self) -> np.dtype:
        """NumPy dtype of one element (uint8 for codes)."""
        return np.dtype(_DTYPES[self.kind])

    @property
    def max_value(self) -> Optional[int]:
        """Largest value of an unsigned code type, else None."""
        return (1 << self.bits) - 1 if self.kind == "uint" else None

    def __str__(self) -> str:
        if self.kind == "uint":
            return "uint8" if self.bits == 8 else f"uint<{self.bits}>"
        return self.kind


_DTYPES = {
    "bool": np.bool_, "uint": np.uint8, "int": np.int32, "long": np.int64,
    "float": np.float32, "double": np.float64,
}

BOOL = Scalar("bool")
INT = Scalar("int")
LONG = Scalar("long")
FLOAT = Scalar("float")
DOUBLE = Scalar("double")
UINT8 = Scalar("uint", 8)


def uint(bits: int) -> Scalar:
    """Return ``uint<bits>``."""
    return Scalar("uint", bits)


@dataclasses.dataclass(frozen=True)
class Length:
    """The symbolic length of an array.

    Attributes:
        key: canonical text; arrays with equal keys have equal lengths (one loop domain).
        expr: the length as an expression of the gradient length and the parameters
            (static), or None when it depends on the data.
        bound: for a data-dependent length, a static upper bound (or None).
    """

    key: str
    expr: Any = None
    bound: Any = None

    @property
    def dynamic(self) -> bool:
        """Whether the length depends on the data (filter results)."""
        return self.expr is None


@dataclasses.dataclass(frozen=True)
class Array:
    """An array of ``elem`` with a symbolic ``length``."""

    elem: Scalar
    length: Length

    def __str__(self) -> str:
        return f"{self.elem}[{self.length.key}]"


@dataclasses.dataclass(frozen=True)
class LambdaType:
    """An elementwise function type."""

    params: Tuple[Scalar, ...]
    ret: Scalar

    def __str__(self) -> str:
        return f"({', '.join(map(str, self.params))}) -> {self.ret}"


@dataclasses.dataclass(frozen=True)
class PayloadType:
    """The encoded payload (``uint8[]`` as encode's result and decode's argument)."""

    def __str__(self) -> str:
        return "payload"


PAYLOAD = PayloadType()


def promote(a: Scalar, b: Scalar) -> Scalar:
    """Return the arithmetic result type of ``a`` and ``b`` (bool and uint<b> act as int)."""
    t = a if a.rank >= b.rank else b
    if t.rank < INT.rank:
        return INT
    return t
