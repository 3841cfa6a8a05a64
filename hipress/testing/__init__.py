"""Test and benchmark support that is not part of the training runtime.

- :mod:`hipress.testing.emucluster` — an emulated cluster on one Linux machine: hosts in
  network namespaces joined by a bridge, every link shaped with ``tc``, launchable with
  ``hipressrun -H`` / ``mpirun`` like ordinary hosts (needs root).

Nothing here is imported by ``import hipress``. Names are loaded on first use, so that
``python -m hipress.testing.emucluster`` runs the module only once.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "EmulatedCluster",
    "EmulationError",
    "cleanup",
    "leftovers",
    "namespaces_unavailable",
    "parse_rate",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("hipress.testing.emucluster"), name)
    raise AttributeError(f"module 'hipress.testing' has no attribute {name!r}")
