"""Errors of SeCoPa: invalid profile and plan files, plans that cannot be made."""

from __future__ import annotations

from typing import Any

from hipress.errors import ConfigError


class SeCoPaError(ConfigError):
    """A SeCoPa profile or plan is invalid or cannot serve the request (names the cause)."""


class ProfileError(SeCoPaError):
    """A profile file is unreadable or invalid, or lacks what a plan needs."""


class PlanError(SeCoPaError):
    """A plan file is unreadable or invalid."""


def format_validation_error(kind: str, origin: str, exc: Any) -> str:
    """Format a pydantic ``ValidationError`` as one line per bad field, dotted path first.

    Args:
        kind: what was validated ("SeCoPa profile", "SeCoPa plan").
        origin: where it came from (a file path, or "<memory>").
        exc: the ``pydantic.ValidationError``.

    Returns:
        A first line ``invalid <kind> <origin>: <the first error> (and N more):`` that
        stands alone where only one line is shown (a launcher's summary), then one line
        per error, ``  field.path: message (got value)``.
    """
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "<top level>"
        given = err.get("input")
        shown = repr(given)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        got = f" (got {shown})" if err.get("type") != "missing" else ""
        lines.append(f"  {where}: {err.get('msg', 'invalid')}{got}")
    first = lines[0].strip() if lines else "invalid"
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return "\n".join([f"invalid {kind} {origin}: {first}{more}:"] + lines)
