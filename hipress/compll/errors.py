"""Errors of the CompLL front end, each pointing at a line and column of the spec."""

from __future__ import annotations

from typing import Optional

from hipress.errors import HiPressError


class CompLLError(HiPressError, ValueError):
    """A CompLL spec is invalid; the message names the file, line, column and the fix.

    Attributes:
        path: the spec file (or ``<string>``).
        line: 1-based line of the offending token (0 when unknown).
        col: 1-based column (0 when unknown).
        reason: the message without the location and the source excerpt.
    """

    kind = "error"

    def __init__(
        self,
        reason: str,
        line: int = 0,
        col: int = 0,
        path: str = "<string>",
        source: Optional[str] = None,
    ) -> None:
        self.reason = reason
        self.line = line
        self.col = col
        self.path = path
        where = f"{path}:{line}:{col}" if line else path
        msg = f"{where}: {self.kind}: {reason}"
        if source is not None and line:
            lines = source.splitlines()
            if 0 < line <= len(lines):
                text = lines[line - 1].replace("\t", " ")
                msg += f"\n    {text}\n    {' ' * max(col - 1, 0)}^"
        super().__init__(msg)


class CompLLSyntaxError(CompLLError):
    """The spec does not follow the grammar; the message lists what was expected."""

    kind = "syntax error"

    def __init__(self, reason: str, line: int, col: int, path: str = "<string>",
                 source: Optional[str] = None, expected: Optional[list] = None) -> None:
        self.expected = sorted(expected or [])
        super().__init__(reason, line, col, path, source)


class CompLLTypeError(CompLLError):
    """The spec is grammatical but ill-typed (caught before any code is generated)."""

    kind = "type error"


class UnsafeCacheError(HiPressError, RuntimeError):
    """The CompLL disk cache can be written by someone other than the current user.

    Every rank runs the generated modules it finds there, so such a cache is refused; the
    message names the folder or file and how to fix it (``chmod go-w``, ``chown``, or
    ``HIPRESS_CACHE_DIR`` set to a private folder).
    """
