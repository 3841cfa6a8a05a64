"""Turn a spec file into a registered codec: compile (or hit the disk cache), import, register.

Generated modules are cached on disk under ``$HIPRESS_CACHE_DIR/compll`` (default
``~/.cache/hipress/compll``), one folder per spec text, named ``<spec>-<sha256[:16]>``
and holding ``codec.py`` (the module), ``codec.sha256`` (the sha256 of ``codec.py``),
``kernels.cu`` (its CUDA source), ``plan.txt`` and a copy of the spec. A cache hit runs
``codec.py`` without parsing the spec; Numba caches its compiled kernels beside it. Writes
are atomic (temporary folder, then rename), so concurrent ranks can share a cache.

Every rank runs what it finds there, so the cache is trusted only when nobody else can
write it: the ``compll`` folder, each entry and its files must belong to the current user
and not be writable by group or others (else :class:`UnsafeCacheError`; new folders are
made ``0o700``). A hit reads ``codec.py`` once, checks its sha256 against ``codec.sha256``
and its ``SPEC_SHA256`` line against the spec, and only then runs those same bytes; an
entry that fails the checks is deleted and generated again.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import types
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import numpy as np

from hipress.backend import array_module
from hipress.codecs.base import (
    Codec,
    Layout,
    register_codec,
    register_codec_loader,
    registered_codec,
)
from hipress.codecs.state import SeededStreamMixin, check_seed
from hipress.compll import runtime as _rt
from hipress.compll.errors import UnsafeCacheError
from hipress.errors import CodecError

logger = logging.getLogger(__name__)

SPEC_DIR = os.path.join(os.path.dirname(__file__), "specs")
#: Codec ids of generated codecs lie in [ID_MIN, ID_MAX): above the hand-written ones.
ID_MIN, ID_MAX = 1000, 65000
#: A codec name as the grammar and the checker allow it (``codec <name> {...}``).
_SPEC_NAME = re.compile(r"[a-z][a-z0-9_]*")

_LOCK = threading.RLock()
_BY_DIGEST: Dict[str, Type[Codec]] = {}
_STATS = {"generated": 0, "disk_hits": 0, "memory_hits": 0}


def cache_dir() -> str:
    """Return the folder of generated modules (``$HIPRESS_CACHE_DIR/compll``)."""
    root = os.environ.get("HIPRESS_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hipress")
    return os.path.join(root, "compll")


def codec_id_for(spec_name: str) -> int:
    """Return the wire id of generated codec ``spec_name``: a hash into [1000, 65000).

    The id depends only on the name, so every rank derives the same one; a clash with
    another registered codec is reported by :func:`load_spec` (rename the spec).
    """
    return ID_MIN + zlib.crc32(f"compll.{spec_name}".encode()) % (ID_MAX - ID_MIN)


def cache_stats() -> Dict[str, int]:
    """Return counters: specs generated, disk-cache hits, in-process hits."""
    return dict(_STATS)


# ----------------------------------------------------------------------- generate
def build_sources(source: str, path: str = "<string>") -> Dict[str, Any]:
    """Parse, check and generate a spec.

    Returns:
        ``{"name", "codec_name", "digest", "module", "cuda", "plan"}``.

    Raises:
        CompLLSyntaxError, CompLLTypeError: the spec is invalid.
    """
    from hipress.compll.check import check
    from hipress.compll.codegen import generate, spec_digest
    from hipress.compll.parser import parse

    info = check(parse(source, path))
    out = generate(info, source, os.path.basename(path))
    out.update(name=info.name, codec_name=info.codec_name, digest=spec_digest(source))
    return out


def _module_name(digest: str) -> str:
    return f"hipress_compll_gen_{digest[:16]}"


def _run_module(name: str, path: str, text: Any) -> Any:
    """Run module text (str or bytes) as module ``name`` with ``__file__`` = ``path``.

    The text is the one already read and checked (or just generated): the file is not read
    again, so it cannot change between the check and the run.
    """
    code = compile(text, path, "exec", dont_inherit=True)
    mod = types.ModuleType(name)
    mod.__file__ = path
    sys.modules[name] = mod
    try:
        exec(code, mod.__dict__)  # noqa: S102 - checked generated code (see _read_entry)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def _unsafe_reason(st: os.stat_result) -> Optional[str]:
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is not None and st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by the current user (uid {uid})"
    if st.st_mode & 0o022:
        return f"writable by its group or by others (mode {oct(st.st_mode & 0o777)})"
    return None


def _refuse(path: str, reason: str, is_dir: bool) -> UnsafeCacheError:
    uid = os.geteuid() if hasattr(os, "geteuid") else "$(id -u)"
    fix = (f"run 'chmod go-w {path}'" if "writable" in reason else
           f"run 'chown {uid} {path}' as its owner or root")
    what = "CompLL cache directory" if is_dir else "CompLL cache file"
    return UnsafeCacheError(
        f"refusing the {what} {path}: it is {reason}, so another user could put code "
        f"there that every rank would run. Fix: {fix}, or set HIPRESS_CACHE_DIR to a "
        "directory only you can write (the cache is then $HIPRESS_CACHE_DIR/compll)")


def check_cache_path(path: str) -> None:
    """Refuse a cache folder or file that someone other than the current user can change.

    Raises:
        UnsafeCacheError: ``path`` belongs to another user or is group- or world-writable
            (the message names it and how to fix it).
        OSError: ``path`` cannot be examined.
    """
    st = os.stat(path)
    reason = _unsafe_reason(st)
    if reason is not None:
        raise _refuse(path, reason, os.path.isdir(path))


def _cache_root() -> str:
    """Create (``0o700``) and check the ``compll`` cache folder; return its path.

    Raises:
        UnsafeCacheError: the folder is not private to the current user.
        OSError: it cannot be created.
    """
    root = cache_dir()
    os.makedirs(root, mode=0o700, exist_ok=True)
    check_cache_path(root)
    return root


def _read_checked(path: str) -> bytes:
    with open(path, "rb") as f:
        reason = _unsafe_reason(os.fstat(f.fileno()))
        if reason is not None:
            raise _refuse(path, reason, False)
        return f.read()


def _read_entry(folder: str, digest: str) -> Optional[bytes]:
    """Return the bytes of a cache entry's ``codec.py`` if they pass the checks, else None.

    Checks: the folder and both files are private (else :class:`UnsafeCacheError`); the
    sha256 of ``codec.py`` equals ``codec.sha256``; it declares ``SPEC_SHA256 = digest``.
    """
    check_cache_path(folder)
    try:
        data = _read_checked(os.path.join(folder, "codec.py"))
        want = _read_checked(os.path.join(folder, "codec.sha256")).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("discarding incomplete CompLL cache entry %s (%s)", folder, exc)
        return None
    if hashlib.sha256(data).hexdigest() != want:
        logger.warning("discarding CompLL cache entry %s: codec.py does not match its "
                       "codec.sha256 (modified or damaged)", folder)
        return None
    if f"\nSPEC_SHA256 = {digest!r}\n".encode() not in data:
        logger.warning("discarding CompLL cache entry %s: it was generated from another "
                       "spec text", folder)
        return None
    return data


def _write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _write_cache(folder: str, built: Dict[str, Any], source: str) -> None:
    parent = os.path.dirname(folder)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        module = built["module"]
        files = {"codec.py": module, "kernels.cu": built["cuda"], "plan.txt": built["plan"],
                 "codec.sha256": hashlib.sha256(module.encode("utf-8")).hexdigest() + "\n",
                 f"{built['name']}.hpc": source}
        for fname, text in files.items():
            _write_file(os.path.join(tmp, fname), text)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.isdir(folder):  # pragma: no cover - a real failure
                raise
            # another process won the race: theirs is identical
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def module_for_source(source: str, path: str = "<string>") -> Any:
    """Return the generated module of a spec's text, from the disk cache when possible.

    Steps: 1. a module of this spec text already run in this process is returned; 2. the
    cache folder is created or checked (:func:`check_cache_path`); 3. an entry whose
    ``codec.py`` passes the checks (see the module docstring) is run; one that fails them
    is deleted and its module dropped from :data:`sys.modules`; 4. otherwise the spec is
    generated, written to the cache (or, if the cache cannot be written, to a temporary
    folder) and the generated text run.

    Raises:
        UnsafeCacheError: the cache folder, the entry or its files are not private to the
            current user (see :func:`check_cache_path`).
        CompLLSyntaxError, CompLLTypeError: the spec is invalid.
    """
    from hipress.compll.codegen import spec_digest

    digest = spec_digest(source)
    mod_name = _module_name(digest)
    mod = sys.modules.get(mod_name)
    if mod is not None and getattr(mod, "SPEC_SHA256", None) == digest:
        return mod
    sys.modules.pop(mod_name, None)
    try:
        root: Optional[str] = _cache_root()
    except OSError as exc:
        logger.warning("cannot create the CompLL cache at %s (%s); set HIPRESS_CACHE_DIR to "
                       "a writable folder", cache_dir(), exc)
        root = None
    folder = os.path.join(root or cache_dir(), f"{_spec_name_hint(source)}-{digest[:16]}")
    mod_path = os.path.join(folder, "codec.py")
    if root is not None and os.path.lexists(folder):
        data = _read_entry(folder, digest)
        if data is not None:
            try:
                mod = _run_module(mod_name, mod_path, data)
                _STATS["disk_hits"] += 1
                return mod
            except Exception as exc:  # a damaged cache entry: regenerate
                logger.warning("discarding damaged CompLL cache entry %s (%s)", folder, exc)
        sys.modules.pop(mod_name, None)
        if os.path.isdir(folder) and not os.path.islink(folder):
            shutil.rmtree(folder, ignore_errors=True)
        else:
            os.unlink(folder)
    built = build_sources(source, path)
    _STATS["generated"] += 1
    written = False
    if root is not None:
        try:
            _write_cache(folder, built, source)
            written = True
        except OSError as exc:
            logger.warning("cannot write the CompLL cache at %s (%s); set HIPRESS_CACHE_DIR "
                           "to a writable folder", folder, exc)
    if not written:
        tmp = tempfile.mkdtemp(prefix="hipress-compll-")
        _write_cache(os.path.join(tmp, "m"), built, source)
        mod_path = os.path.join(tmp, "m", "codec.py")
    return _run_module(mod_name, mod_path, built["module"])


def _spec_name_hint(source: str) -> str:
    """Return the codec name of a spec's header (for the cache folder name), or "spec"."""
    m = re.search(r"\bcodec\s+([a-z][a-z0-9_]*)", source)
    return m.group(1) if m else "spec"


# ------------------------------------------------------------------- codec class
def _check_param(p: Dict[str, Any], value: Any, codec: str) -> Any:
    kind, name = p["kind"], p["name"]
    where = f"{codec} parameter {name!r}"
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise CodecError(f"{where} must be true or false, got {value!r}")
        return bool(value)
    if isinstance(value, (bool, np.bool_)):
        raise CodecError(f"{where} must be a number, got {value!r}")
    try:
        v = float(value) if kind in ("float", "double") else value
        if kind in ("int", "long"):
            if isinstance(value, float) and value.is_integer():
                v = int(value)
            if not isinstance(v, (int, np.integer)):
                raise TypeError
            v = int(v)
    except (TypeError, ValueError):
        what = "an integer" if kind in ("int", "long") else "a number"
        raise CodecError(f"{where} must be {what}, got {value!r}") from None
    lo, hi = p["lo"], p["hi"]
    bad = (isinstance(v, float) and math.isnan(v)) or \
        (lo is not None and (v < lo or (v == lo and not p["lo_closed"]))) or \
        (hi is not None and (v > hi or (v == hi and not p["hi_closed"])))
    if bad:
        raise CodecError(f"{where} must be in {p['range']}, got {value!r}")
    if kind == "float":
        return np.float32(v)
    if kind == "double":
        return np.float64(v)
    if kind == "int" and not -2**31 <= v < 2**31:
        raise CodecError(f"{where} must fit in 32 bits, got {value!r}")
    return v


class CompLLCodec(SeededStreamMixin, Codec):
    """Base of codecs generated from CompLL specs (one subclass per spec).

    The subclass's ``spec`` attribute is the generated module; its header flags become the
    capability flags. Parameters are the spec's ``param`` declarations (validated against
    their declared ranges); stochastic specs also take ``seed`` (an integer in [0, 2**32))
    and keep one step counter per gradient name, checkpointed by :meth:`state_dict`, plus
    ``rank`` (set by the engine) so that ``random`` draws independently on each rank.
    """

    spec: Any = None
    #: Checkpoint layout of the counters: ``{"steps": {name: step}}`` (see
    #: :class:`~hipress.codecs.state.StepCounterMixin`); ``bind`` sets the rank.
    steps_key = "steps"

    def __init__(self, **params: Any) -> None:
        mod = self.spec
        known = {p["name"]: p for p in mod.PARAMS}
        allowed = set(known) | ({"seed"} if self.stochastic else set())
        extra = sorted(set(params) - allowed)
        if extra:
            raise CodecError(f"unknown parameter(s) {extra} for codec {self.name!r}; valid: "
                             f"{sorted(allowed) or 'none'}")
        self._raw = {p["name"]: params.get(p["name"], p["default"]) for p in mod.PARAMS}
        self._P = {k: _check_param(known[k], v, self.name) for k, v in self._raw.items()}
        self.seed = 0
        self.rank = 0
        self._init_steps()
        if self.stochastic:
            self.seed = check_seed(params.get("seed", 0), self.name, bits=32)
            self._raw["seed"] = self.seed

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return dict(self._raw)

    def _context(self, name: str) -> _rt.EncodeContext:
        if not self.stochastic:
            return _rt.EncodeContext(name)
        return _rt.EncodeContext(name, self.seed, self._next_step(name), self.rank)

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        xp = array_module(flat)
        want = self.spec.INPUT_DTYPE
        g = flat if flat.dtype == want else flat.astype(want)
        if g.size >= 2**31:
            raise CodecError(f"{self.name}: gradients of 2**31 elements or more are not "
                             "supported by CompLL codecs (int32 indices); partition it")
        with np.errstate(all="ignore"):
            return self.spec.encode(xp, g, self._P, self._context(name))

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        n = math.prod(shape)
        xp = array_module(sections[0]) if sections else np
        with np.errstate(all="ignore"):
            out = self.spec.decode(xp, list(sections), n, self._P, _rt.EncodeContext(""))
        return out.astype(dtype, copy=False)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        return [(np.dtype(dt), int(c)) for dt, c in self.spec.layout(math.prod(shape), self._P)]

    def state_dict(self) -> Dict[str, Any]:
        """Return ``{"steps": {gradient name: next step}}`` (empty for deterministic specs)."""
        return super().state_dict() if self.stochastic else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the step counters of :meth:`state_dict`.

        Raises:
            CodecError: unknown keys or a step that is not a non-negative integer (for
                deterministic specs: any key).
        """
        if self.stochastic:
            super().load_state_dict(state)
        else:
            Codec.load_state_dict(self, state)


def _make_class(mod: Any) -> Type[Codec]:
    flags = mod.FLAGS
    doc = (f"CompLL codec generated from spec {mod.SPEC_NAME!r}.\n\n"
           f"Parameters: {', '.join(p['name'] for p in mod.PARAMS) or 'none'}.")
    cls = type(f"CompLL_{mod.SPEC_NAME}", (CompLLCodec,), {
        "__doc__": doc, "__module__": __name__, "spec": mod,
        "variable_size": bool(flags["variable_size"]), "stochastic": bool(flags["stochastic"]),
        "lossless": bool(flags["lossless"]), "error_feedback": bool(flags["error_feedback"]),
        "summable": False,
    })
    return cls


def load_source(source: str, path: str = "<string>") -> Type[Codec]:
    """Compile spec text (or reuse it) and register its codec; return the codec class.

    Loading the same text twice returns the same class. A different spec that claims a
    registered codec name, or whose id clashes with another codec, raises.

    Raises:
        CompLLSyntaxError, CompLLTypeError: the spec is invalid.
        CodecError: the codec name or id is taken by another codec.
    """
    from hipress.compll.codegen import spec_digest

    digest = spec_digest(source)
    with _LOCK:
        cls = _BY_DIGEST.get(digest)
        if cls is not None:
            _STATS["memory_hits"] += 1
            return cls
        mod = module_for_source(source, path)
        name = mod.CODEC_NAME
        existing = registered_codec(name)
        if existing is not None:
            old = getattr(existing, "spec", None)
            raise CodecError(
                f"codec name {name!r} is already registered"
                + (f" by another spec (sha {old.SPEC_SHA256[:12]})" if old is not None else "")
                + f"; rename the spec in {path} ('codec <name> {{...}}')")
        cls = _make_class(mod)
        register_codec(name, codec_id_for(mod.SPEC_NAME))(cls)
        _BY_DIGEST[digest] = cls
        logger.debug("registered CompLL codec %s (id %d) from %s", name, cls.codec_id, path)
        return cls


def load_spec(path: str) -> Type[Codec]:
    """Load a ``.hpc`` spec file and register its codec (``compll.<name>``).

    Args:
        path: the spec file.

    Returns:
        The registered Codec subclass; build instances with ``cls(**params)`` or
        ``hipress.codecs.get_codec(cls.name, **params)``.

    Raises:
        FileNotFoundError: no such file.
        CompLLSyntaxError, CompLLTypeError: the spec is invalid (line and column given).
        CodecError: its name or id clashes with a registered codec.
    """
    with open(path, encoding="utf-8") as f:
        source = f.read()
    return load_source(source, path)


def builtin_spec_paths() -> List[str]:
    """Return the paths of the specs shipped with HiPress, sorted."""
    return sorted(os.path.join(SPEC_DIR, f) for f in os.listdir(SPEC_DIR) if f.endswith(".hpc"))


def register_builtin_specs() -> List[str]:
    """Load every shipped spec (idempotent); return their codec names."""
    return [load_spec(p).name for p in builtin_spec_paths()]


_ALL_BUILTIN_LOADED = False


def _load_builtin(name: str) -> None:
    path = spec_path_for(name)
    if path is not None:
        load_spec(path)


def _load_all_builtin() -> None:
    global _ALL_BUILTIN_LOADED
    if not _ALL_BUILTIN_LOADED:
        register_builtin_specs()
        _ALL_BUILTIN_LOADED = True


def install_codec_loader() -> None:
    """Install the codec registry's loader of ``compll.<name>``: the shipped spec ``<name>``.

    Done when :mod:`hipress.compll` is imported; a name with no shipped spec is left to the
    registry's "unknown codec" error.
    """
    register_codec_loader("compll.", _load_builtin, _load_all_builtin)


def resolve_algorithm(algorithm: str) -> str:
    """Return the registered codec name for a config's ``compression.algorithm``.

    A value ending in ``.hpc`` is a spec file: it is loaded (compiled or taken from the
    cache) and its codec name ``compll.<name>`` returned. A ``compll.*`` name loads the
    shipped specs first. Any other name is returned unchanged.

    Raises:
        FileNotFoundError: the spec file does not exist.
        CompLLError: the spec is invalid.
    """
    if algorithm.endswith(".hpc"):
        return load_spec(os.path.expanduser(algorithm)).name
    if algorithm.startswith("compll."):
        register_builtin_specs()
    return algorithm


def spec_path_for(name: str) -> Optional[str]:
    """Return the shipped spec file of ``name`` (``onebit`` or ``compll.onebit``), if any.

    Only codec names (lower case letters, digits and '_') are looked up, so a name such as
    ``compll.../x`` never reaches outside the shipped specs.
    """
    short = name.split(".", 1)[1] if name.startswith("compll.") else name
    if not _SPEC_NAME.fullmatch(short):
        return None
    path = os.path.join(SPEC_DIR, f"{short}.hpc")
    return path if os.path.isfile(path) else None
