"""Error-feedback memories: what a biased codec leaves out is added back next step.

Memories are separate from codecs (GRACE's ``memory/`` role): a codec compresses, a
memory keeps per-gradient state keyed by stable gradient names, in float32 whatever the
gradient dtype, and is part of checkpoints through ``state_dict``/``load_state_dict``.
"""

from hipress.memory import dgc  # noqa: F401  (registers "dgc")
from hipress.memory.base import (
    Memory,
    NoMemory,
    ResidualMemory,
    get_memory,
    memory_names,
    register_memory,
)

__all__ = [
    "Memory",
    "NoMemory",
    "ResidualMemory",
    "get_memory",
    "memory_names",
    "register_memory",
]
