"""Compression codecs: the registry and the built-in algorithms, one per module.

>>> from hipress.codecs import get_codec
>>> codec = get_codec("fp16")
>>> payload = codec.encode(np.ones(3, np.float32), name="fc.weight")
>>> codec.decode(payload)

Built-in codecs register themselves on import; see :func:`codec_names` for the list.
Generated codecs (``compll.*``) come from a :class:`~hipress.codecs.base.CodecLoader`
that :mod:`hipress.compll` installs: this package never imports ``hipress.compll``.
"""

# Built-in codecs register themselves on import (one algorithm per module).
from hipress.codecs import (  # noqa: F401
    cast,
    dgc,
    graddrop,
    identity,
    minmax8,
    onebit,
    powersgd,
    qsgd,
    randomk,
    signsgd,
    tbq,
    terngrad,
    topk,
)
from hipress.codecs.base import (
    Codec,
    Payload,
    codec_class,
    codec_names,
    get_codec,
    layout_nbytes,
    register_codec,
    register_codec_loader,
)

__all__ = [
    "Codec",
    "Payload",
    "codec_class",
    "codec_names",
    "get_codec",
    "layout_nbytes",
    "register_codec",
    "register_codec_loader",
]

