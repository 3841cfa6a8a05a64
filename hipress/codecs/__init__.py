"""Compression codecs: the registry and the built-in algorithms, one per module.

>>> from hipress.codecs import get_codec
>>> codec = get_codec("fp16")
>>> payload = codec.encode(np.ones(3, np.float32), name="fc.weight")
>>> codec.decode(payload)

Built-in codecs register themselves on import; see :func:`codec_names` for the list.
"""

import importlib

from hipress.codecs import cast, identity  # noqa: F401  (registration)
from hipress.codecs.base import (
    Codec,
    Payload,
    codec_class,
    codec_names,
    get_codec,
    layout_nbytes,
    register_codec,
)

__all__ = [
    "Codec",
    "Payload",
    "codec_class",
    "codec_names",
    "get_codec",
    "layout_nbytes",
    "register_codec",
]

# Built-in codec modules register themselves on import.
# TODO(lead): import these directly once every module exists.
for _mod in ("onebit", "tbq", "terngrad", "qsgd", "signsgd", "minmax8", "topk", "randomk", "dgc",
             "graddrop", "powersgd"):
    try:
        importlib.import_module(f"hipress.codecs.{_mod}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"hipress.codecs.{_mod}":
            raise
