"""Framework-neutral helpers shared by the framework adapters (PyTorch, TensorFlow, MXNet).

An adapter hooks the framework's gradient-ready points, converts tensors to NumPy/CuPy
arrays zero-copy, and calls the core. Everything that does not depend on the framework
lives here, so the three adapters behave alike:

- :class:`GradientSynchronizer`: per-step bookkeeping of one distributed optimizer. It
  counts backward passes per gradient (local accumulation), submits a gradient to the
  engine as soon as its last pass is done, zero-fills gradients a rank does not have
  (``contributes=False``, so nobody waits and the rank's residual is untouched), waits
  for every result at the end of the step and resets the counts.
- name rules (:func:`check_unique_names`, :func:`default_gradient_name`),
- codec selection (:func:`resolve_codec`),
- checkpoint packing of the engine's state into the framework optimizer's state
  (:func:`pack_state`, :func:`unpack_state`, :func:`tree_map`),
- splitting a nested state into a picklable skeleton plus array leaves, so large arrays
  travel through :func:`hipress.broadcast` and only the small skeleton is pickled
  (:func:`split_leaves`, :func:`join_leaves`),
- ``key=value`` parsing of codec parameters for example scripts (:func:`parse_params`),
- Horovod porting aids (:class:`Compression`, :func:`check_horovod_args`,
  :func:`predivide_scales`): Horovod's names mean the same here, and Horovod arguments
  HiPress does not implement fail with a message naming them and the alternative.

Local accumulation rule (the same as Horovod's): with ``backward_passes_per_step = k`` the
framework sums the ``k`` local gradients (PyTorch accumulates into ``.grad``), and the
engine then averages the local sums across ranks. Rank 0 with passes 1 and 3 and rank 1
with passes 5 and 7 therefore end the step with (1 + 3 + 5 + 7) / 2 = 8, not 4. Scale the
loss by ``1/k`` if you want the mean over passes.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import logging
import numbers
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from hipress.errors import HiPressError

logger = logging.getLogger(__name__)

#: Reduction ops the adapters accept (``hp.Average``, ``hp.Sum``, ``hp.Min``, ``hp.Max``,
#: ``hp.Product``, as Horovod's). Min, Max and Product run uncompressed.
Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"
_OPS = (Average, Sum, Min, Max, Product)

#: Key under which the engine's state sits inside a framework optimizer's state dict.
HIPRESS_STATE_KEY = "hipress"


class BackwardPassError(HiPressError, RuntimeError):
    """A gradient was computed more often than ``backward_passes_per_step`` in one step."""


def check_op(op: Any) -> str:
    """Return ``op`` normalized to a core op name (``"average"``, ``"sum"``, ``"min"``, ...).

    Args:
        op: one of those names (any case), or the adapters' ``Average``, ``Sum``, ``Min``,
            ``Max``, ``Product``.

    Raises:
        UnsupportedArgumentError: Horovod's ``Adasum`` (see :func:`check_horovod_op`).
        ValueError: any other op; the message lists the valid ones.
    """
    check_horovod_op(op)
    norm = str(op).lower()
    if norm not in _OPS:
        raise ValueError(f"unknown reduction op {op!r}; valid ops: {', '.join(_OPS)}")
    return norm


def check_unique_names(names: Iterable[str], what: str = "parameter") -> List[str]:
    """Return ``names`` as a list after checking that no name repeats.

    Gradients are matched across ranks by name, and error-feedback residuals are keyed by
    it, so two tensors with one name would mix their state.

    Args:
        names: the gradient names, in order.
        what: noun used in the message ("parameter", "tensor").

    Raises:
        ValueError: a name occurs more than once; the message lists every duplicate.
        TypeError: a name is not a non-empty string.
    """
    names = list(names)
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"{what} names must be non-empty strings, got {n!r}")
    counts = collections.Counter(names)
    dups = sorted(n for n, c in counts.items() if c > 1)
    if dups:
        raise ValueError(
            f"{what} names must be unique because ranks match gradients by name; "
            f"duplicates: {', '.join(repr(d) for d in dups)}. Pass e.g. "
            "model.named_parameters() of a single model, or prefix the names of each model"
        )
    return names


def default_gradient_name(group_index: int, param_index: int) -> str:
    """Return the name given to an unnamed parameter: its position in the param groups.

    Positions are the same on every rank when every rank builds the same optimizer.
    """
    return f"param.{group_index}.{param_index}"


def resolve_codec(compression: Any, params: Optional[Mapping[str, Any]] = None,
                  gradients: bool = False) -> Any:
    """Turn an adapter's ``compression`` argument into the engine's ``codec`` argument.

    Args:
        compression: None: for ``gradients`` the job's compression policy
            (``compression.algorithm``, per-layer rules, ``min_compress_bytes``, warm-up),
            otherwise no codec (an exact collective). ``"auto"``: the policy in either
            case. A registered codec name (``"onebit"``, ``"none"`` for uncompressed,
            ...) or a :class:`Compression` attribute (``Compression.fp16``, the same
            name), a CompLL spec path ending in ``.hpc``, or a
            :class:`hipress.codecs.Codec` instance: that codec for every tensor, whatever
            its size and the step.
        params: codec constructor parameters (only with a name). Horovod argument
            names (``process_set``, ``num_groups``, ...) are refused first, see
            :func:`check_horovod_args`.
        gradients: True for optimizer wrappers, DDP hooks and trainers, False for the
            collectives users call directly (``allreduce`` of metrics must be exact).

    Returns:
        None (exact), :data:`hipress.POLICY`, the name (when there are no params), or a
        Codec instance.

    Raises:
        UnsupportedArgumentError: ``params`` holds a Horovod argument HiPress does not
            implement (the message names it and what to do instead).
        ValueError: ``params`` without a codec name.
        CodecError: unknown codec name (valid names are listed) or bad parameters.
        TypeError: ``compression`` is of an unsupported type.
    """
    from hipress.codecs import Codec, codec_class, get_codec
    from hipress.engine import POLICY

    params = dict(params or {})
    check_horovod_args(params)  # Horovod's own arguments are not codec parameters
    if compression is None or compression == POLICY:
        if params:
            raise ValueError(
                f"codec parameters {sorted(params)} given without a compression name; "
                "pass compression='<codec>' too, or put them in the config's compression.params"
            )
        return POLICY if gradients or compression == POLICY else None
    if isinstance(compression, Codec):
        return get_codec(compression, **params)
    if isinstance(compression, str):
        compression = str(compression)  # a Compression attribute is its plain name
        if compression.endswith(".hpc"):
            if params:
                raise ValueError("parameters of a CompLL spec belong in the spec file")
            return compression
        codec_class(compression)  # validates early; lists the valid names
        return get_codec(compression, **params) if params else compression
    raise TypeError(
        "compression must be None, 'auto', a codec name, an hp.Compression attribute or a "
        f"Codec instance, got {type(compression)}"
    )


def parse_params(items: Optional[Iterable[str]]) -> Dict[str, Any]:
    """Parse ``key=value`` strings (command-line codec parameters) into a dict.

    Values are Python literals when they parse as one (``0.01``, ``2``, ``True``,
    ``None``, ``[1, 2]``), strings otherwise.

    Raises:
        ValueError: an item has no ``=`` or an empty key.
    """
    out: Dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"expect key=value, got {item!r} (e.g. --param ratio=0.01)")
        try:
            out[key] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            out[key] = raw.strip()
    return out


# ------------------------------------------------------------- Horovod porting aids
class CompressionChoice(str):
    """A codec name chosen through :class:`Compression` (``Compression.fp16 == "fp16"``).

    It *is* the name (a ``str``), so it works wherever a codec name does; only its
    ``repr`` differs (``Compression.fp16``), to read like the Horovod code it came from.
    """

    def __repr__(self) -> str:
        return f"Compression.{str(self)}"


class _CompressionNamespace(type):
    """Metaclass of :class:`Compression`: unknown attributes list the valid ones."""

    def __getattr__(cls, name: str) -> CompressionChoice:
        if name.startswith("__"):
            raise AttributeError(name)
        from hipress.codecs import codec_names

        if name in codec_names():  # a codec registered after import (a user's, CompLL's)
            return CompressionChoice(name)
        raise AttributeError(
            f"Compression has no attribute {name!r}; valid: {', '.join(cls.names())} "
            "(or pass compression='<codec name>' / a Codec instance directly)"
        )

    def __iter__(cls) -> Iterable[CompressionChoice]:
        return iter(getattr(cls, n) for n in cls.names())


class Compression(metaclass=_CompressionNamespace):
    """Horovod's ``hvd.Compression``: one attribute per built-in codec.

    Scripts ported from Horovod keep ``compression=hvd.Compression.fp16``; every attribute
    is the codec's registered name (a :class:`CompressionChoice`, a ``str``), accepted by
    every ``compression=`` argument (``DistributedOptimizer``, ``DistributedGradientTape``,
    ``DistributedTrainer``, DDP hooks, ``allreduce``) through :func:`resolve_codec`.

    ``Compression.none`` is the codec ``"none"``: exact, uncompressed synchronization of
    every gradient, whatever its size and the step (Horovod's meaning). It is *not* the
    same as ``compression=None``, which for gradient wrappers (optimizers, tapes,
    trainers, DDP hooks) follows the job's compression policy (``compression.algorithm``
    of the config, per-layer rules, ``min_compress_bytes``, warm-up) and for direct
    collectives (``allreduce``) means exact. To let the config decide, pass None or
    ``"auto"``; to force exact gradients, pass ``Compression.none``.

    Attributes: ``none``, ``fp16``, ``bf16`` (casts); ``onebit``, ``tbq``, ``terngrad``,
    ``qsgd``, ``minmax8``, ``signsgd``, ``efsignsgd`` (quantizers); ``dgc``,
    ``graddrop``, ``topk``, ``randomk`` (sparsifiers); ``powersgd`` (low rank). A codec
    registered later (:func:`hipress.codecs.register_codec`) is reachable by its name as
    well. Unknown attributes raise ``AttributeError`` listing the valid ones.
    """

    none = CompressionChoice("none")
    fp16 = CompressionChoice("fp16")
    bf16 = CompressionChoice("bf16")
    onebit = CompressionChoice("onebit")
    tbq = CompressionChoice("tbq")
    terngrad = CompressionChoice("terngrad")
    qsgd = CompressionChoice("qsgd")
    minmax8 = CompressionChoice("minmax8")
    signsgd = CompressionChoice("signsgd")
    efsignsgd = CompressionChoice("efsignsgd")
    dgc = CompressionChoice("dgc")
    graddrop = CompressionChoice("graddrop")
    topk = CompressionChoice("topk")
    randomk = CompressionChoice("randomk")
    powersgd = CompressionChoice("powersgd")

    @classmethod
    def names(cls) -> List[str]:
        """Return the names of the built-in attributes, in declaration order."""
        return [k for k, v in vars(cls).items() if isinstance(v, CompressionChoice)]


#: Horovod's ``hvd.Adasum`` op, exported so ported scripts reach the clear error of
#: :func:`check_horovod_op` rather than an ``AttributeError``. HiPress does not implement it.
Adasum = "adasum"


class UnsupportedArgumentError(HiPressError, TypeError, ValueError):
    """A Horovod argument that HiPress does not implement was given.

    Derives from ``TypeError`` (an unexpected keyword argument) and ``ValueError`` (a
    value HiPress refuses), so either handler catches it.
    """


_SYNC_ALL = "HiPress synchronizes over all ranks of the job"
_GROUPING = ("HiPress groups tensors itself (small uncompressed tensors are fused up to "
             "sync.fusion_threshold_bytes, large ones partitioned); drop the argument")
#: Horovod argument -> why HiPress refuses it and what to do instead.
HOROVOD_UNSUPPORTED: Dict[str, str] = {
    "process_set": f"process sets are not supported; {_SYNC_ALL}. Drop the argument, or "
                   "start one HiPress job per group of ranks",
    "num_groups": f"explicit allreduce groups are not supported; {_GROUPING}",
    "groups": f"explicit allreduce groups are not supported; {_GROUPING}",
    "sparse_as_dense": "it has no meaning here: this adapter synchronizes dense gradients "
                       "only. Drop the argument",
    "device_dense": "HiPress reduces each tensor on the device it lives on; drop the argument",
    "device_sparse": "HiPress reduces each tensor on the device it lives on; drop the argument",
    "prescale_factor": "scale the tensor before the call (e.g. tensor * factor) instead",
    "postscale_factor": "scale the result after the call instead",
    "average": "the deprecated average= flag is not supported; pass op=hp.Average or "
               "op=hp.Sum",
    "average_aggregated_gradients": "local passes are summed (Horovod's default); scale the "
                                    "loss by 1/backward_passes_per_step for their mean",
    "scale_local_gradients": f"local gradients are not a separate group: {_SYNC_ALL}; drop "
                             "the argument",
    "ignore_name_scope": "gradient names come from the variables' paths; drop the argument",
}


def check_horovod_args(kwargs: Mapping[str, Any], api: str = "",
                       allow: Iterable[str] = ()) -> None:
    """Refuse Horovod arguments HiPress does not implement, before they pass as codec params.

    The adapters take ``**codec_params`` (``ratio=0.01``); without this check a ported
    ``process_set=...`` would be reported as a codec parameter given without a codec.

    Args:
        kwargs: the keyword arguments an adapter API received beyond its own.
        api: the API's name, for the message (e.g. ``"DistributedOptimizer"``).
        allow: names this API handles itself (skipped).

    Raises:
        UnsupportedArgumentError: the first Horovod argument found (sorted by name); the
            message names it, says HiPress does not support it, and what to do instead.
    """
    allowed = set(allow)
    for key in sorted(kwargs):
        if key in HOROVOD_UNSUPPORTED and key not in allowed:
            where = f"{api}(" if api else "the "
            close = ")" if api else " call"
            raise UnsupportedArgumentError(
                f"{where}{key}={kwargs[key]!r}{close}: the Horovod argument {key!r} is not "
                f"supported by HiPress: {HOROVOD_UNSUPPORTED[key]}"
            )


def refuses_horovod_args(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an adapter function so Horovod arguments it lacks get a clear error.

    A ported ``hvd.broadcast(t, 0, process_set=ps)`` raises
    :class:`UnsupportedArgumentError` naming the argument (see
    :func:`check_horovod_args`) instead of Python's bare "unexpected keyword argument".
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            check_horovod_args(
                {k: v for k, v in kwargs.items() if k in HOROVOD_UNSUPPORTED}, fn.__name__)
        return fn(*args, **kwargs)

    return wrapper


def check_horovod_op(op: Any, api: str = "") -> None:
    """Refuse Horovod ops HiPress does not implement (``hp.Adasum``); pass others through.

    Raises:
        UnsupportedArgumentError: ``op`` is Adasum.
    """
    if str(op).lower() == Adasum:
        where = f"{api}(op=Adasum)" if api else "op=Adasum"
        raise UnsupportedArgumentError(
            f"{where}: the Adasum reduction is not supported by HiPress; pass op=hp.Average "
            "(the default) or op=hp.Sum, and choose a codec with compression=... to cut "
            "traffic"
        )


def predivide_scales(factor: Any, op: str, size: int) -> Tuple[float, float]:
    """Validate ``gradient_predivide_factor`` and return (prescale, postscale).

    Horovod's semantics: gradients are multiplied by ``1/f`` before the sum and the sum
    by ``f/size`` after it, so the result is the plain average whatever ``f`` (a larger
    ``f`` keeps low-precision sums away from overflow, a smaller one from underflow). The
    engine's ``"average"`` already divides by ``size``, so the postscale returned here is
    ``f`` itself.

    Args:
        factor: ``f``, a real number in ``[1, size]``; 1 means no predivision (and no
            extra multiplication at all: the result is bit-identical to no factor).
        op: the normalized reduction op (``"average"`` or ``"sum"``).
        size: the world size.

    Returns:
        ``(1/f, f)``: multiply each local gradient by the first before it is submitted and
        each averaged result by the second.

    Raises:
        ConfigError: ``f`` is not a number, outside ``[1, size]``, or not 1 while ``op``
            is not ``"average"`` (a sum has no division to share, as in Horovod).
    """
    from hipress.errors import ConfigError

    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise ConfigError(
            f"gradient_predivide_factor must be a number in [1, world size = {size}], got "
            f"{factor!r}"
        )
    f = float(factor)
    if not 1.0 <= f <= size:
        if size == 1:
            raise ConfigError(
                f"gradient_predivide_factor={factor!r} is outside the valid range [1, 1]: at "
                "world size 1 only 1 (no predivision) is valid. Pass 1, or make it depend "
                "on the world size (e.g. min(f, hp.size()))"
            )
        raise ConfigError(
            f"gradient_predivide_factor={factor!r} is outside the valid range [1, {size}] "
            f"(1 .. world size): the gradients are divided by it before the sum and the sum "
            f"by world size / factor after it. Pass a value between 1 (no predivision) and "
            f"{size} (divide everything before the sum)"
        )
    if f != 1.0 and op != Average:
        raise ConfigError(
            f"gradient_predivide_factor={factor!r} needs op=hp.Average (got op={op!r}): it "
            "splits the averaging division around the sum, and a sum has none. Use "
            "op=hp.Average, or scale the loss yourself with op=hp.Sum"
        )
    return 1.0 / f, f


def scale_array(array: Any, factor: float, inplace: bool) -> Any:
    """Return ``array * factor`` in ``array``'s dtype (written into ``array`` if ``inplace``).

    Args:
        array: a NumPy or CuPy float array.
        factor: the multiplier; 1.0 returns ``array`` unchanged.
        inplace: write into ``array`` (it must be writable and owned by the caller).
    """
    if factor == 1.0:
        return array
    if inplace:
        array *= array.dtype.type(factor)
        return array
    return (array * array.dtype.type(factor)).astype(array.dtype, copy=False)


# --------------------------------------------------------------------------- the step
@dataclasses.dataclass
class _Entry:
    passes: int = 0
    handle: Any = None
    array: Any = None  # keeps the zero-copy source alive until the result is in
    contributes: bool = True


class GradientSynchronizer:
    """Per-step bookkeeping of a distributed optimizer's gradient synchronization.

    The adapter calls :meth:`gradient_ready` from the framework's per-gradient hook and
    :meth:`synchronize` before the optimizer update. Per step:

    1. each ready gradient counts one backward pass; on its ``backward_passes_per_step``-th
       pass its (locally summed) array is submitted with :func:`hipress.allreduce_async`,
       so synchronization overlaps the rest of the backward pass;
    2. one pass more than ``backward_passes_per_step`` raises :class:`BackwardPassError`;
    3. :meth:`synchronize` submits every gradient not submitted yet: the accumulated array
       if the rank has one (fewer passes than configured, e.g. at the end of an epoch),
       otherwise zeros with ``contributes=False`` (an unused parameter: the rank still
       takes part, its residual is untouched);
    4. it waits for every handle, resets the counts, and returns the results by name.

    Args:
        names: the gradient names this optimizer owns (unique; checked).
        op: ``"average"`` or ``"sum"`` across ranks.
        codec: the engine's ``codec`` argument (see :func:`resolve_codec`).
        backward_passes_per_step: local passes summed before each synchronization (>= 1).
        inplace: the arrays handed in are the framework's own writable gradient buffers:
            the engine writes each result into its array (see
            :func:`hipress.allreduce_async`), so no result array is allocated per step.
        gradient_predivide_factor: Horovod's ``f`` in ``[1, world size]``: each gradient
            is multiplied by ``1/f`` before it is submitted and each average by ``f``
            after (see :func:`predivide_scales`); 1 touches nothing. Scaling happens in
            place with ``inplace``, on a copy otherwise (the framework's tensors are not
            modified).

    Raises:
        ValueError: duplicate names, a bad op, or ``backward_passes_per_step < 1``.
        ConfigError: a bad ``gradient_predivide_factor``.
    """

    def __init__(
        self,
        names: Sequence[str],
        op: str = Average,
        codec: Any = None,
        backward_passes_per_step: int = 1,
        inplace: bool = False,
        gradient_predivide_factor: float = 1.0,
    ) -> None:
        self.names = check_unique_names(names)
        self.inplace = bool(inplace)
        self.op = check_op(op)
        self.codec = codec
        self.prescale, self.postscale = 1.0, 1.0
        if gradient_predivide_factor != 1:
            import hipress

            self.prescale, self.postscale = predivide_scales(
                gradient_predivide_factor, self.op, hipress.size())
        k = backward_passes_per_step
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {k!r}")
        self.backward_passes_per_step = int(k)
        self._entries: Dict[str, _Entry] = {n: _Entry() for n in self.names}

    # ------------------------------------------------------------------ queries
    @property
    def in_progress(self) -> bool:
        """True between the first counted pass of a step and the end of :meth:`synchronize`."""
        return any(e.passes or e.handle is not None for e in self._entries.values())

    def passes(self, name: str) -> int:
        """Return how many backward passes of ``name`` were counted in this step."""
        return self._entries[name].passes

    def submitted(self, name: str) -> bool:
        """Return True if ``name`` was submitted to the engine in this step."""
        return self._entries[name].handle is not None

    # ------------------------------------------------------------------- events
    def gradient_ready(self, name: str, get_array: Callable[[], Any]) -> bool:
        """Count one backward pass of ``name``; submit it on the last pass of the step.

        Args:
            name: a name given at construction.
            get_array: returns the gradient as a NumPy/CuPy array (called only when the
                gradient is submitted; the array must stay valid until the result is in).

        Returns:
            True if the gradient was submitted by this call.

        Raises:
            KeyError: ``name`` is not one of this optimizer's gradients.
            BackwardPassError: this is pass ``backward_passes_per_step + 1`` of the step.
        """
        entry = self._entry(name)
        entry.passes += 1
        k = self.backward_passes_per_step
        if entry.passes > k:
            raise BackwardPassError(
                f"gradient {name!r} was computed {entry.passes} times since the last step(), "
                f"but backward_passes_per_step={k}. Call step() (or zero_grad()) after every "
                f"{k} backward pass(es), or raise backward_passes_per_step to accumulate more "
                "passes locally"
            )
        if entry.passes == k:
            self._submit(name, get_array(), contributes=True)
            return True
        return False

    def synchronize(
        self,
        get_array: Callable[[str], Optional[Any]],
        zeros: Callable[[str], Any],
    ) -> Dict[str, Any]:
        """Submit what is missing, wait for every gradient, reset the step, return results.

        Args:
            get_array: ``name -> array or None``: the accumulated gradient of a gradient
                not submitted yet, or None if this rank has none (unused parameter).
            zeros: ``name -> array`` of zeros shaped like the gradient (the stand-in
                submitted with ``contributes=False``).

        Returns:
            ``{name: synchronized array}`` for every name, in construction order.

        Raises:
            HiPressError: whatever the engine raised (the step is reset first).
        """
        import hipress

        try:
            for name in self.names:
                entry = self._entries[name]
                if entry.handle is not None:
                    continue
                arr = get_array(name) if entry.passes else None
                if arr is None:
                    self._submit(name, zeros(name), contributes=False)
                else:
                    logger.debug(
                        "gradient %r synchronized after %d of %d backward passes",
                        name, entry.passes, self.backward_passes_per_step,
                    )
                    self._submit(name, arr, contributes=True)
            return {n: scale_array(hipress.synchronize(self._entries[n].handle),
                                   self.postscale, self.inplace)
                    for n in self.names}
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget the counts and handles of this step (results not waited for are dropped)."""
        for entry in self._entries.values():
            entry.passes = 0
            entry.handle = None
            entry.array = None
            entry.contributes = True

    # ----------------------------------------------------------------- internal
    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a gradient of this optimizer") from None

    def _submit(self, name: str, array: Any, contributes: bool) -> None:
        import hipress

        entry = self._entries[name]
        if contributes:
            array = scale_array(array, self.prescale, self.inplace)
        entry.array = array
        entry.contributes = contributes
        entry.handle = hipress.allreduce_async(
            array, name=name, op=self.op, codec=self.codec, contributes=contributes,
            inplace=self.inplace,
        )


# ------------------------------------------------------------------ state packing
def pack_state(framework_state: Dict[str, Any], engine_state: Any) -> Dict[str, Any]:
    """Return ``framework_state`` plus the engine's state under :data:`HIPRESS_STATE_KEY`.

    Raises:
        ValueError: ``framework_state`` already uses the key.
    """
    if HIPRESS_STATE_KEY in framework_state:
        raise ValueError(
            f"optimizer state already has a {HIPRESS_STATE_KEY!r} entry; the HiPress state "
            "would overwrite it"
        )
    out = dict(framework_state)
    out[HIPRESS_STATE_KEY] = engine_state
    return out


def unpack_state(state: Mapping[str, Any]) -> Tuple[Dict[str, Any], Any]:
    """Split a state made by :func:`pack_state` into (framework state, engine state or None)."""
    out = dict(state)
    return out, out.pop(HIPRESS_STATE_KEY, None)


def tree_map(fn: Callable[[Any], Any], tree: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """Apply ``fn`` to the leaves of nested dicts/lists/tuples for which ``is_leaf`` is True.

    Containers are rebuilt (mappings become dicts, OrderedDicts stay OrderedDicts, named
    tuples keep their type); other values are returned unchanged.
    """
    if is_leaf(tree):
        return fn(tree)
    if isinstance(tree, Mapping):
        out = {k: tree_map(fn, v, is_leaf) for k, v in tree.items()}
        return collections.OrderedDict(out) if isinstance(tree, collections.OrderedDict) else out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(tree_map(fn, v, is_leaf) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v, is_leaf) for v in tree)
    return tree


@dataclasses.dataclass(frozen=True)
class LeafSlot:
    """Placeholder for an array leaf in a skeleton made by :func:`split_leaves`.

    Attributes:
        index: position of the leaf in the leaves list.
        meta: what the adapter needs to rebuild an empty leaf (shape, dtype name, ...);
            plain picklable values only.
    """

    index: int
    meta: Any


def split_leaves(
    tree: Any, is_leaf: Callable[[Any], bool], describe: Callable[[Any], Any]
) -> Tuple[Any, List[Any]]:
    """Split a nested state into a picklable skeleton and its array leaves.

    Used to broadcast an optimizer state: the small skeleton goes through
    :func:`hipress.broadcast_object`, each leaf through :func:`hipress.broadcast`.

    Args:
        tree: nested dicts/lists/tuples.
        is_leaf: True for the values to take out (framework tensors).
        describe: ``leaf -> meta`` stored in the :class:`LeafSlot` (e.g. shape and dtype).

    Returns:
        (skeleton with :class:`LeafSlot` in place of each leaf, leaves in slot order).
    """
    leaves: List[Any] = []

    def take(x: Any) -> LeafSlot:
        leaves.append(x)
        return LeafSlot(len(leaves) - 1, describe(x))

    return tree_map(take, tree, is_leaf), leaves


def join_leaves(skeleton: Any, make: Callable[[LeafSlot], Any]) -> Any:
    """Rebuild a tree from a skeleton of :func:`split_leaves`, calling ``make`` per slot."""
    return tree_map(make, skeleton, lambda x: isinstance(x, LeafSlot))


def leaf_slots(skeleton: Any) -> List[LeafSlot]:
    """Return the :class:`LeafSlot` entries of a skeleton, ordered by index."""
    slots: List[LeafSlot] = []
    tree_map(slots.append, skeleton, lambda x: isinstance(x, LeafSlot))
    return sorted(slots, key=lambda s: s.index)


# ------------------------------------------------------- pass-level accumulation
class PassAccumulator:
    """Local accumulation and synchronization for adapters that see a whole pass at once.

    TensorFlow's ``apply_gradients`` and Gluon's ``Trainer.step`` receive every gradient of
    one backward pass together, with no per-gradient hook. This class turns those calls
    into the same per-step behaviour as the PyTorch adapter (Horovod's rule): with
    ``backward_passes_per_step = k`` the ``k`` local gradients are summed and the sums are
    averaged (or summed) across ranks. Per call of :meth:`add_pass`:

    1. the pass is counted;
    2. with ``k == 1`` each present gradient is submitted at once, zero-copy (the array
       must stay valid until :meth:`add_pass` returns); with ``k > 1`` it is added into a
       local accumulator (a copy on its first pass, in place afterwards) and counted by a
       :class:`GradientSynchronizer`, which submits the accumulator on the gradient's
       ``k``-th pass;
    3. on passes ``1 .. k-1`` the call returns None (the adapter skips the update);
    4. on pass ``k`` it submits what is missing (accumulated gradients with fewer passes
       as they are; gradients this rank never had as zeros with ``contributes=False``, so
       nobody waits and this rank's residual is untouched), waits for every result,
       resets the step, calls :func:`hipress.step` and returns the results by name.

    Args:
        names: the gradient names (unique; checked).
        op: ``"average"`` or ``"sum"`` across ranks.
        codec: the engine's ``codec`` argument (see :func:`resolve_codec`).
        backward_passes_per_step: passes summed locally before each synchronization.
        gradient_predivide_factor: Horovod's predivision (see :class:`GradientSynchronizer`).

    Raises:
        ValueError: duplicate names, a bad op, or ``backward_passes_per_step < 1``.
        ConfigError: a bad ``gradient_predivide_factor``.
    """

    def __init__(
        self,
        names: Sequence[str],
        op: str = Average,
        codec: Any = None,
        backward_passes_per_step: int = 1,
        gradient_predivide_factor: float = 1.0,
    ) -> None:
        self.sync = GradientSynchronizer(names, op, codec, backward_passes_per_step,
                                         gradient_predivide_factor=gradient_predivide_factor)
        self.names = self.sync.names
        self.backward_passes_per_step = self.sync.backward_passes_per_step
        self.passes = 0
        self._acc: Dict[str, Any] = {}

    def add_pass(
        self,
        arrays: Mapping[str, Optional[Any]],
        zeros: Callable[[str], Any],
    ) -> Optional[Dict[str, Any]]:
        """Count one backward pass; on the last pass of a step return the synchronized arrays.

        Args:
            arrays: ``name -> NumPy/CuPy array`` of this pass, or None (or a missing key)
                for a gradient this rank does not have in this pass.
            zeros: ``name -> array`` of zeros shaped like the gradient.

        Returns:
            None on passes ``1 .. k-1``; on pass ``k`` ``{name: synchronized array}`` for
            every name (new arrays, bit-identical on every rank).

        Raises:
            KeyError: ``arrays`` names a gradient that is not one of ``names``.
            HiPressError: the engine failed (the step is reset first).
        """
        from hipress.backend import array_module

        unknown = [n for n in arrays if n not in self.sync._entries]
        if unknown:
            raise KeyError(f"gradients {unknown[:5]} are not among this accumulator's names")
        k = self.backward_passes_per_step
        self.passes += 1
        try:
            for name in self.names:
                arr = arrays.get(name)
                if arr is None:
                    continue
                if k == 1:
                    self.sync.gradient_ready(name, lambda a=arr: a)
                    continue
                acc = self._acc.get(name)
                if acc is None:
                    self._acc[name] = array_module(arr).array(arr, copy=True)
                else:
                    acc += arr
                self.sync.gradient_ready(name, lambda n=name: self._acc[n])
            if self.passes < k:
                return None
            results = self.sync.synchronize(self._acc.get, zeros)
        except BaseException:
            self.reset()
            raise
        self.passes = 0
        self._acc.clear()
        import hipress

        hipress.step()
        return results

    def reset(self) -> None:
        """Drop the passes accumulated in this step (results not waited for are dropped)."""
        self.passes = 0
        self._acc.clear()
        self.sync.reset()


def unique_names(candidates: Sequence[str], prefix: str = "grad") -> List[str]:
    """Return gradient names from the framework's own names, made unique if they are not.

    TensorFlow variables created without a name are all called ``Variable:0``; such a list
    cannot key gradients across ranks. When every candidate is distinct (Keras paths such
    as ``dense/kernel``, Gluon names such as ``dense0_weight``) they are returned as they
    are (a ``:0`` suffix dropped); otherwise every name gets its position,
    ``<prefix>.<i>.<name>``, which is the same on every rank that builds the same model.

    Args:
        candidates: one name per gradient, in a rank-independent order.
        prefix: first component of positional names.

    Returns:
        A list of unique names of the same length.
    """
    names = [c[:-2] if c.endswith(":0") else c for c in (str(c) for c in candidates)]
    if len(set(names)) == len(names) and all(names):
        return names
    return [f"{prefix}.{i}.{n}" for i, n in enumerate(names)]


# ------------------------------------------------------ state as bytes (no pickle)
_STATE_MAGIC = "hipress-state-v1"


def encode_state(state: Any) -> bytes:
    """Serialize an engine state (:func:`hipress.state_dict`) to bytes, without pickle.

    For checkpoint formats that store one string or byte blob (a TensorFlow
    ``PythonState``, a Gluon ``Trainer.save_states`` file).

    Layout: a NumPy ``.npz`` archive (``allow_pickle=False``) with entry ``skeleton``, a
    UTF-8 JSON document of the nested structure, and entries ``a<i>``, the raw bytes of the
    ``i``-th array as ``uint8``. In the JSON, an array is ``{"__array__": i, "dtype": name,
    "shape": [...], "scalar": bool}`` (NumPy scalars come back as NumPy scalars), a tuple is
    ``{"__tuple__": [...]}`` and a dict is ``{"__dict__": [[key, value], ...]}`` (keys may
    be any of these types). Arrays are restored bit-identically, bfloat16 included.

    Args:
        state: nested dicts/lists/tuples of NumPy arrays, NumPy scalars, str, int, float,
            bool and None.

    Returns:
        The serialized bytes.

    Raises:
        TypeError: a value of another type (the message names its path).
    """
    import io
    import json

    import numpy as np

    blobs: List[Any] = []

    def enc(x: Any, path: str) -> Any:
        if isinstance(x, (np.ndarray, np.generic)):
            a = np.array(x, copy=True, order="C")  # 0-d stays 0-d (unlike ascontiguousarray)
            blobs.append(a.reshape(-1).view(np.uint8))
            return {"__array__": len(blobs) - 1, "dtype": a.dtype.name, "shape": list(a.shape),
                    "scalar": isinstance(x, np.generic)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, Mapping):
            return {"__dict__": [[enc(k, f"{path}.<key>"), enc(v, f"{path}.{k}")]
                                 for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]
        raise TypeError(
            f"cannot serialize {type(x).__name__} at state{path}: expect NumPy arrays, "
            "NumPy scalars, str/int/float/bool/None and dicts/lists/tuples of them"
        )

    skeleton = json.dumps({"magic": _STATE_MAGIC, "tree": enc(state, "")})
    buf = io.BytesIO()
    entries = {f"a{i}": b for i, b in enumerate(blobs)}
    entries["skeleton"] = np.frombuffer(skeleton.encode("utf-8"), dtype=np.uint8)
    np.savez(buf, **entries)
    return buf.getvalue()


def decode_state(data: bytes) -> Any:
    """Invert :func:`encode_state`.

    Raises:
        ValueError: ``data`` is not an encoded HiPress state.
    """
    import io
    import json

    import numpy as np

    from hipress.backend import bfloat16

    try:
        archive = np.load(io.BytesIO(bytes(data)), allow_pickle=False)
        doc = json.loads(archive["skeleton"].tobytes().decode("utf-8"))
    except Exception as exc:  # noqa: BLE001  (any parse failure means: not our format)
        raise ValueError(f"not a serialized HiPress state ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("magic") != _STATE_MAGIC:
        raise ValueError("not a serialized HiPress state (missing magic); was it written by "
                         "hipress.adapter_common.encode_state?")

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "__array__" in x:
            dt = bfloat16 if x["dtype"] == "bfloat16" else np.dtype(x["dtype"])
            a = archive[f"a{x['__array__']}"].view(dt).reshape(x["shape"]).copy()
            return a[()] if x["scalar"] else a
        if "__tuple__" in x:
            return tuple(dec(v) for v in x["__tuple__"])
        return {dec(k): dec(v) for k, v in x["__dict__"]}

    return dec(doc["tree"])
