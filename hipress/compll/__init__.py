"""CompLL: a small language for gradient compression algorithms, and its code generator.

Part three of HiPress (Bai et al., SOSP'21, section 5): an algorithm is written as an
``encode`` and a ``decode`` function over a gradient in a few dozen lines (a ``.hpc``
spec); the generator lowers it to fused CPU kernels (Numba) and CUDA kernels (CuPy) and
registers a codec ``compll.<name>`` that every adapter can use by name. Importing this
package installs the registry's loader for ``compll.*`` names (the registry itself never
imports CompLL), so ``get_codec("compll.onebit")`` compiles or loads the shipped spec.

>>> from hipress import compll
>>> cls = compll.load_spec("my_algorithm.hpc")      # compiled, cached, registered
>>> codec = cls(threshold=0.01)                       # or get_codec("compll.my_algorithm")

A job config may name a spec file directly (``compression.algorithm: path/to/x.hpc``);
:func:`resolve_algorithm` turns that into the registered codec name. The language is
described in ``LANGUAGE.md`` beside this file; shipped specs are in ``specs/``.

Pipeline: :mod:`~hipress.compll.parser` (lark grammar, errors with line, column and the
tokens expected) -> :mod:`~hipress.compll.check` (types, lengths, capabilities; every
error before code generation) -> :mod:`~hipress.compll.plan` (fusion of maps,
reductions, filters and bit packing into passes) -> :mod:`~hipress.compll.cpu` /
:mod:`~hipress.compll.cuda` (kernels) -> :mod:`~hipress.compll.codegen` (one module) ->
:mod:`~hipress.compll.loader` (disk cache, codec class, registry).
"""

from __future__ import annotations

from hipress.compll.errors import (
    CompLLError,
    CompLLSyntaxError,
    CompLLTypeError,
    UnsafeCacheError,
)
from hipress.compll.loader import (
    build_sources,
    builtin_spec_paths,
    cache_dir,
    codec_id_for,
    install_codec_loader,
    load_source,
    load_spec,
    register_builtin_specs,
    resolve_algorithm,
    spec_path_for,
)

install_codec_loader()

__all__ = [
    "CompLLError",
    "CompLLSyntaxError",
    "CompLLTypeError",
    "UnsafeCacheError",
    "build_sources",
    "builtin_spec_paths",
    "cache_dir",
    "codec_id_for",
    "load_source",
    "load_spec",
    "register_builtin_specs",
    "resolve_algorithm",
    "spec_path_for",
]
