"""Typed, strict job configuration: YAML file, environment and overrides.

A HiPress job is described by one YAML file with six sections (``job``, ``cluster``,
``compression``, ``sync``, ``timeline``, ``logging``); ``configs/default.yaml`` lists every
key with its default. The file loads into :class:`HiPressConfig`, a tree of pydantic
models that refuse unknown keys and wrong types: a typo fails at load time with its dotted
path and the valid keys at that level, instead of being silently ignored.

Precedence (each layer overrides the ones before it, key by key):

1. defaults (the field defaults below; an empty YAML file means all defaults);
2. the YAML file: the ``path`` argument of :func:`load_config`, else the file named by the
   environment variable ``HIPRESS_CONFIG`` (``hipressrun --config`` sets it for workers);
3. single-key environment overrides::

       HIPRESS_TIMELINE       -> timeline
       HIPRESS_COMPRESSION    -> compression.algorithm
       HIPRESS_STRATEGY       -> sync.strategy
       HIPRESS_STALL_SHUTDOWN -> sync.stall_shutdown_s  (seconds; HIPRESS_STALL_TIMEOUT too)
       HIPRESS_STALL_WARNING  -> sync.stall_warning_s   (a number of seconds)
       HIPRESS_FUSION_THRESHOLD -> sync.fusion_threshold_bytes (bytes, an integer)
       HIPRESS_CYCLE_TIME     -> sync.cycle_time_ms     (milliseconds)
       HIPRESS_LOG_LEVEL      -> logging.level
       HIPRESS_TRANSPORT      -> transport

   (an empty variable counts as unset);
4. explicit overrides: the ``overrides`` argument, a dict of dotted keys to values
   (``{"sync.strategy": "ring", "compression.params.ratio": 0.01}``), as the command line of
   ``hipressrun`` or keyword overrides in code pass them.

Example:
    >>> from hipress.config import load_config
    >>> cfg = load_config("configs/digits-torch.yaml", overrides={"sync.strategy": "ring"})
    >>> cfg.compression.algorithm
    'onebit'

Every validation problem is reported at once in one :class:`~hipress.errors.ConfigError`
(a ``ValueError``), one line per problem, naming the key, what was expected and where the
value came from (file, environment variable or override).
"""

from __future__ import annotations

import copy
import difflib
import inspect
import logging
import os
import shlex
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple, Type, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hipress.errors import ConfigError

__all__ = [
    "ENV_OVERRIDES",
    "ClusterConfig",
    "CompressionConfig",
    "CompressionRule",
    "HiPressConfig",
    "JobConfig",
    "LoggingConfig",
    "SyncConfig",
    "config_from_dict",
    "dump_effective",
    "load_config",
]

logger = logging.getLogger(__name__)

#: Environment variable -> (dotted key, kind of value). ``HIPRESS_CONFIG`` names the file.
ENV_OVERRIDES: Dict[str, Tuple[str, str]] = {
    "HIPRESS_TIMELINE": ("timeline", "str"),
    "HIPRESS_COMPRESSION": ("compression.algorithm", "str"),
    "HIPRESS_STRATEGY": ("sync.strategy", "str"),
    "HIPRESS_STALL_SHUTDOWN": ("sync.stall_shutdown_s", "float"),
    "HIPRESS_STALL_TIMEOUT": ("sync.stall_shutdown_s", "float"),
    "HIPRESS_STALL_WARNING": ("sync.stall_warning_s", "float"),
    "HIPRESS_FUSION_THRESHOLD": ("sync.fusion_threshold_bytes", "int"),
    "HIPRESS_CYCLE_TIME": ("sync.cycle_time_ms", "float:milliseconds"),
    "HIPRESS_LOG_LEVEL": ("logging.level", "str"),
    "HIPRESS_TRANSPORT": ("transport", "str"),
}

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_STRICT = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


# ----------------------------------------------------------------------------- helpers
def _scalar_to_str(value: Any, what: str) -> Any:
    """Turn a YAML number into its text (``--epochs: 5`` style args); refuse booleans."""
    if isinstance(value, bool):
        raise ValueError(
            f"{what} must be a string, not a boolean; quote it ('{str(value).lower()}')"
        )
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _string_list(value: Any, what: str) -> Any:
    """Accept a list of strings/numbers, or one string split like a shell would (no shell)."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"cannot split {what} {value!r} into words: {exc}") from None
    if isinstance(value, (list, tuple)):
        return [_scalar_to_str(v, f"each item of {what}") for v in value]
    return value


def _check_algorithm(value: str) -> str:
    """Check a codec name against the registry (or accept a CompLL ``.hpc`` spec path)."""
    if value.endswith(".hpc"):
        return value
    from hipress.codecs import codec_names

    names = codec_names()
    if value not in names:
        close = difflib.get_close_matches(value, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown codec {value!r}{hint}; valid codecs: {', '.join(names)}, "
            "or the path of a CompLL spec ending in .hpc"
        )
    return value


def _check_codec_params(params: Dict[str, Any], info: ValidationInfo) -> Dict[str, Any]:
    """Check ``params`` against the constructor of the already validated codec name.

    Steps: 1. skip when the algorithm failed validation or is a ``.hpc`` spec (CompLL
    checks those); 2. refuse parameter names the constructor does not take, listing the
    valid ones; 3. build the codec once so its own range checks run now, at load time.
    """
    algorithm = info.data.get("algorithm")
    if not algorithm or algorithm.endswith(".hpc"):
        return params
    from hipress.codecs import codec_class

    cls = codec_class(algorithm)
    sig = inspect.signature(cls)
    kinds = {p.kind for p in sig.parameters.values()}
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        valid = [
            n for n, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        unknown = sorted(set(params) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {', '.join(map(repr, unknown))} for codec "
                f"{algorithm!r}; valid parameters: {', '.join(valid) or '(none)'}"
            )
    try:
        cls(**params)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"codec {algorithm!r} refuses these params: {exc}") from None
    return params


# ----------------------------------------------------------------------------- models
class JobConfig(BaseModel):
    """What every worker runs.

    Attributes:
        command: the program and its fixed arguments, a list of strings (one string is
            split with :func:`shlex.split`; nothing is ever run through a shell).
        args: extra arguments appended to ``command``.
    """

    model_config = _STRICT

    command: List[str] = Field(default_factory=list)
    args: List[str] = Field(default_factory=list)

    @field_validator("command", "args", mode="before")
    @classmethod
    def _words(cls, value: Any, info: ValidationInfo) -> Any:
        return _string_list(value, f"job.{info.field_name}")


class ClusterConfig(BaseModel):
    """Where the workers run (read by ``hipressrun``).

    Attributes:
        np: number of worker processes (ranks), >= 1.
        hosts: ``"h1:2,h2:2"`` or a list of ``"host:slots"``; None means localhost.
        hostfile: path of an Open MPI style hostfile (``HOST slots=N`` lines).
        network_interface: network interface for MPI traffic (e.g. ``eth0``).
        ssh_port: ssh port of the remote hosts.
        env: environment variables forwarded to every worker (NAME: value).
    """

    model_config = _STRICT

    np: int = Field(1, ge=1)
    hosts: Optional[Union[str, List[str]]] = None
    hostfile: Optional[str] = None
    network_interface: Optional[str] = None
    ssh_port: Optional[int] = Field(None, ge=1, le=65535)
    env: Dict[str, str] = Field(default_factory=dict)

    @field_validator("hosts", mode="after")
    @classmethod
    def _check_hosts(cls, value: Any) -> Any:
        if value is None:
            return value
        try:
            from hipress.launch.hosts import HostError, parse_hosts
        except ImportError:  # running from a source tree without the launcher installed
            return value
        try:
            parse_hosts(value)
        except HostError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_values(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: _scalar_to_str(v, f"the value of {k}") for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _one_host_source(self) -> ClusterConfig:
        if self.hosts is not None and self.hostfile is not None:
            raise ValueError("give either hosts or hostfile, not both")
        return self


class CompressionRule(BaseModel):
    """A per-layer override of the compression policy; the first matching rule wins.

    Attributes:
        pattern: :func:`fnmatch.fnmatch` pattern on the gradient name (``"*.bias"``).
        algorithm: codec name for matching gradients (``none`` keeps them uncompressed).
        params: constructor parameters of that codec.
    """

    model_config = _STRICT

    pattern: str = Field(min_length=1)
    algorithm: str = "none"
    params: Dict[str, Any] = Field(default_factory=dict)

    @field_validator("algorithm")
    @classmethod
    def _algorithm(cls, value: str) -> str:
        return _check_algorithm(value)

    @field_validator("params")
    @classmethod
    def _params(cls, value: Dict[str, Any], info: ValidationInfo) -> Dict[str, Any]:
        return _check_codec_params(value, info)


class CompressionConfig(BaseModel):
    """The compression policy.

    Attributes:
        algorithm: codec name (:func:`hipress.codecs.codec_names`) or a CompLL ``.hpc`` path.
        params: codec constructor parameters (``ratio: 0.01``, ``rank: 2``, ...).
        memory: error feedback: ``auto`` (residual when the codec sets ``error_feedback``),
            ``none``, ``residual`` or ``dgc``.
        min_compress_bytes: gradients smaller than this (bytes) are sent uncompressed
            through fused buffers.
        warmup_steps: the first N training steps run uncompressed.
        rules: per-layer overrides, first match wins.
    """

    model_config = _STRICT

    algorithm: str = "none"
    params: Dict[str, Any] = Field(default_factory=dict)
    memory: Literal["auto", "none", "residual", "dgc"] = "auto"
    min_compress_bytes: int = Field(65536, ge=0)
    warmup_steps: int = Field(0, ge=0)
    rules: List[CompressionRule] = Field(default_factory=list)

    @field_validator("algorithm")
    @classmethod
    def _algorithm(cls, value: str) -> str:
        return _check_algorithm(value)

    @field_validator("params")
    @classmethod
    def _params(cls, value: Dict[str, Any], info: ValidationInfo) -> Dict[str, Any]:
        return _check_codec_params(value, info)


class SyncConfig(BaseModel):
    """How CaSync synchronizes gradients.

    Attributes:
        strategy: ``auto`` (chosen per gradient), ``ps`` or ``ring``.
        partitions: None = from ``partition_bytes``; an int >= 1 forces that many
            partitions per gradient.
        partition_bytes: gradients larger than this (bytes) are split into
            ``ceil(bytes / partition_bytes)`` partitions.
        fusion_threshold_bytes: maximum bytes of one fused buffer of small uncompressed
            gradients.
        cycle_time_ms: negotiation cycle (milliseconds; finite, > 0): while gradients
            arrive, a negotiation round starts at most once per cycle; a rank that waits
            for (or polls) a result starts one at once. Default 20: a round costs every
            rank about 0.5 ms of CPU, and a backward pass on a loaded CPU yields a
            gradient every 10-20 ms, so a 1 ms cycle ran one round per gradient (4-rank
            ResNet-50 training: 138 rounds per step at 1 ms, 55 at 20 ms; engine CPU
            360 -> 273 ms per step). Horovod's ``HOROVOD_CYCLE_TIME``.
        max_cycle_time_ms: the longest cycle (milliseconds; finite, > 0; below
            ``cycle_time_ms`` it counts as ``cycle_time_ms``). While the gradients
            submitted since the last round hold fewer than ``partition_bytes``, the next
            round waits up to this long instead of one cycle, so small gradients share a
            round; as soon as a partition's worth is queued, or a rank waits for a result,
            the round starts after one cycle as before. Default 80: on 2 cores with 4
            ranks, ResNet-50 training ran about 100 rounds per step at a fixed 20 ms
            cycle, each 0.5-1 ms of a rank's CPU (an ``Iallgather`` over TCP and its
            tests); with this rule about 70 (engine CPU 0.26 -> 0.21-0.24 s per rank and
            step, together with one ``Testsome`` per poll, bench/README.md). A backward
            pass that yields a partition per cycle or more (any GPU) keeps the 20 ms
            cycle. Set it to ``cycle_time_ms`` for a fixed cycle.
        stall_warning_s: while a gradient is submitted by some ranks only, or a rank stops
            answering, rank 0 (or the waiting rank) logs a warning every this many seconds
            naming the gradients and the ranks missing them (finite, > 0; Horovod's
            ``HOROVOD_STALL_CHECK_TIME_SECONDS``).
        stall_shutdown_s: after this many seconds of such a stall every rank raises
            :class:`~hipress.errors.StallError` and the job ends; 0 (default) never
            (a rank may legitimately spend minutes on evaluation or a checkpoint);
            finite, >= 0 (Horovod's ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``). The old key
            ``stall_timeout_s`` is read as this one.
        compute_threads: threads for encode/decode; 0 (default) runs them inline on the
            engine thread. A pool thread per rank costs a wake-up and a GIL hand-off per
            step: at 2 ranks on 2 cores the ResNet-50 core took 175 ms with one thread and
            103-118 ms inline (onebit), and 4-rank training stepped 7-11% faster inline.
            More threads can pay where cores outnumber ranks several times over.
        blas_threads: threads of NumPy's BLAS library while the engine runs (the
            process-wide setting; restored at shutdown); 0 keeps the library's own
            (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS`` or one per core). Default 1:
            matrix codecs (PowerSGD) run on the engine's compute server, and with several
            ranks per machine a BLAS thread per core and rank made each product 4-25x
            slower (see :mod:`hipress.engine.blas`).
        plan: ``none``, ``auto`` or the path of a SeCoPa plan file.
        plan_observe_steps: with ``plan: auto``, the training steps (after the first
            compressed one) run under the fixed policy with an in-memory timeline before
            SeCoPa plans the whole gradient set from them: the arrival times over the
            backward pass and the codec costs measured under training load
            (:mod:`hipress.secopa.runtime`). 0 plans each gradient on arrival from the
            init-time profile alone (a sum of per-gradient costs, no overlap).
        plan_verify_steps: with ``plan: auto``, the training steps the job times under
            its plan (after one step that settles it) before keeping it: when their
            median (each step timed on its slowest rank) is more than the plan's
            ``min_gain`` (3 %) above the observed fixed-policy steps' median, every rank
            goes back to the fixed policy for good. Rank 0's value applies (it is sent
            with the plan). The cost model ranks options from a profile;
            this check catches where it misprices the job (on 2 cores shared by 4
            ranks its PowerSGD plans stepped 1.21-1.26x the fixed policy,
            bench/README.md). 0 follows the plan unchecked. Plans that are the fixed
            policy (``basis: threshold``) are not timed.
        plan_save: with ``plan: auto``, a path where rank 0 writes the plan it made (a
            plan file for ``plan: <path>`` in later jobs: they skip the observation);
            a plan being timed (``plan_verify_steps``) is written once kept, a plan
            that lost to the fixed policy is not written.
    """

    model_config = _STRICT

    strategy: Literal["auto", "ps", "ring"] = "auto"
    partitions: Optional[int] = Field(None, ge=1)
    partition_bytes: int = Field(4 * 1024 * 1024, ge=1)
    fusion_threshold_bytes: int = Field(64 * 1024 * 1024, ge=0)
    cycle_time_ms: float = Field(20.0, gt=0, allow_inf_nan=False)
    max_cycle_time_ms: float = Field(80.0, gt=0, allow_inf_nan=False)
    stall_warning_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    stall_shutdown_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    compute_threads: int = Field(0, ge=0)
    blas_threads: int = Field(1, ge=0)
    plan: str = Field("none", min_length=1)
    plan_observe_steps: int = Field(3, ge=0)
    plan_verify_steps: int = Field(3, ge=0)
    plan_save: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _stall_timeout_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "stall_timeout_s" in data:
            data = dict(data)
            old = data.pop("stall_timeout_s")
            data.setdefault("stall_shutdown_s", old)  # the new key wins (the environment's)
        return data

    @property
    def stall_limit_s(self) -> float:
        """Seconds after which a stall is fatal (``inf`` when ``stall_shutdown_s`` is 0)."""
        return self.stall_shutdown_s if self.stall_shutdown_s > 0 else float("inf")


class LoggingConfig(BaseModel):
    """Logging of the ``hipress`` loggers.

    Attributes:
        level: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case; stored upper case).
    """

    model_config = _STRICT

    level: str = "INFO"

    @field_validator("level")
    @classmethod
    def _level(cls, value: str) -> str:
        up = value.upper()
        if up not in _LOG_LEVELS:
            raise ValueError(f"unknown log level {value!r}; valid levels: {', '.join(_LOG_LEVELS)}")
        return up


class HiPressConfig(BaseModel):
    """The whole job configuration (see the module docstring for precedence).

    Attributes:
        job: what the workers run.
        cluster: where they run.
        compression: the compression policy.
        sync: the synchronization settings.
        timeline: path of a Chrome-trace JSON timeline, or None for no timeline.
        logging: logging settings.
        transport: how ranks talk: ``mpi`` (mpi4py), ``torch`` (a ``torch.distributed``
            gloo process group, e.g. under ``torchrun``) or ``auto`` (MPI under an MPI
            launcher, else torch when a default process group exists or torchrun's
            variables are set; see :func:`hipress.comm.choose_transport`).
    """

    model_config = _STRICT

    job: JobConfig = Field(default_factory=JobConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    timeline: Optional[str] = None
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    transport: Literal["auto", "mpi", "torch"] = "auto"

    def to_dict(self) -> Dict[str, Any]:
        """Return the config as plain Python values (every key, defaults included)."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """Return the config as YAML text that :func:`load_config` reads back unchanged."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @classmethod
    def from_yaml(cls, path: Union[str, os.PathLike]) -> HiPressConfig:
        """Load a YAML file with no environment or overrides (see :func:`load_config`)."""
        return load_config(path, env={})


# ----------------------------------------------------------------------------- errors
_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping (key: value)",
    "model_type": "a mapping (key: value)",
    "model_attributes_type": "a mapping (key: value)",
}


def _annotation_model(annotation: Any) -> Optional[Type[BaseModel]]:
    """Return the pydantic model inside an annotation (``List[Rule]`` -> ``Rule``)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _annotation_model(arg)
        if found is not None:
            return found
    return None


def _model_at(loc: Tuple[Any, ...]) -> Optional[Type[BaseModel]]:
    """Return the model class that holds the key at ``loc`` (None if not a model)."""
    cls: Optional[Type[BaseModel]] = HiPressConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part) if cls is not None else None
        if field is None:
            return None
        cls = _annotation_model(field.annotation)
    return cls


def _dotted(loc: Tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _describe(err: Dict[str, Any]) -> str:
    """Turn one pydantic error into 'what was expected, what was given'."""
    kind = err["type"]
    loc = tuple(err["loc"])
    ctx = err.get("ctx") or {}
    given = err.get("input")
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        valid = list(model.model_fields) if model is not None else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown key{hint}; valid keys: {', '.join(valid)}"
    if kind == "missing":
        return "required key is missing"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {given!r}"
    if kind == "greater_than_equal":
        return f"expected a value >= {ctx.get('ge')}, got {given!r}"
    if kind == "greater_than":
        return f"expected a value > {ctx.get('gt')}, got {given!r}"
    if kind == "finite_number":
        return f"expected a finite number, got {given!r}"
    if kind == "less_than_equal":
        return f"expected a value <= {ctx.get('le')}, got {given!r}"
    if kind == "string_too_short":
        return f"expected a non-empty string, got {given!r}"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected')}, got {given!r}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return f"{err['msg']}, got {given!r}"


def _format_errors(
    exc: ValidationError, origin: Optional[str], sources: Mapping[str, str]
) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = _dotted(loc)
        # Attribute the error to the layer that set this key (longest matching prefix).
        src = None
        for n in range(len(loc), 0, -1):
            src = sources.get(".".join(str(p) for p in loc[:n]))
            if src:
                break
        suffix = f" (from {src})" if src else ""
        lines.append(f"  {where}: {_describe(err)}{suffix}")
    head = "invalid HiPress config" + (f" in {origin}" if origin else "") + ":"
    return "\n".join([head, *lines])


def config_from_dict(
    data: Optional[Mapping[str, Any]],
    origin: Optional[str] = None,
    sources: Optional[Mapping[str, str]] = None,
) -> HiPressConfig:
    """Validate a nested dict (as read from YAML) into a :class:`HiPressConfig`.

    Args:
        data: nested mapping of sections; None or empty means all defaults.
        origin: where ``data`` came from, for messages (a file path).
        sources: dotted key -> description of who set it (for messages only).

    Returns:
        The validated config, missing keys filled with defaults.

    Raises:
        ConfigError: unknown keys, wrong types or out-of-range values; one line per problem
            with its dotted path, what is expected and where it came from.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"invalid HiPress config{' in ' + origin if origin else ''}: expected a mapping "
            f"of sections (job, cluster, compression, sync, timeline, logging), "
            f"got {type(data).__name__}"
        )
    try:
        return HiPressConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin, sources or {})) from None


# ----------------------------------------------------------------------------- loading
class _StrictLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses duplicate keys (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: Dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key!r}", key_node.start_mark,
            )
        seen[key] = True
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML:\n{exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path!r} must hold a mapping of sections (job, cluster, compression, "
            f"sync, timeline, logging), not a {type(data).__name__}"
        )
    return data


def _set_dotted(data: Dict[str, Any], key: str, value: Any, source: str) -> None:
    """Set ``data[a][b][c] = value`` for ``key = "a.b.c"``, creating mappings on the way."""
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"invalid override key {key!r} (from {source}): empty path component")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(
                f"cannot set {key!r} (from {source}): {'.'.join(parts[: i + 1])} is "
                f"{child!r}, not a mapping"
            )
        node = child
    node[parts[-1]] = value


def _env_value(name: str, raw: str, kind: str) -> Any:
    if kind.startswith("float"):
        unit = kind.partition(":")[2] or "seconds"
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(
                f"environment variable {name}={raw!r} must be a number of {unit}"
            ) from None
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(
                f"environment variable {name}={raw!r} must be an integer number of bytes"
            ) from None
    return raw


def load_config(
    path: Optional[Union[str, os.PathLike]] = None,
    overrides: Optional[Mapping[str, Any]] = None,
    env: Optional[Mapping[str, str]] = None,
    base: Optional[Mapping[str, Any]] = None,
) -> HiPressConfig:
    """Build the effective config: defaults < YAML file < environment < overrides.

    Args:
        path: YAML file; None means the file named by ``HIPRESS_CONFIG`` in ``env``, or
            none at all (defaults).
        base: a nested dict in the YAML schema used instead of a file (a config given in
            code, ``hipress.init({...})``); the environment still applies over it, so
            ``hipressrun --timeline`` and ``HIPRESS_*`` variables work with it.
        overrides: dotted key -> value, applied last (``{"cluster.np": 2}``). A value may
            also be a mapping (``{"sync": {"strategy": "ring"}}``).
        env: the environment to read (``HIPRESS_CONFIG`` and :data:`ENV_OVERRIDES`);
            None means :data:`os.environ`. Pass ``{}`` to ignore the environment.

    Returns:
        The validated config.

    Raises:
        ConfigError: the file is missing, not YAML, or any value is invalid (all problems
            listed, each with its dotted path and source).
    """
    env = os.environ if env is None else env
    origin: Optional[str] = None
    if base is not None:
        data: Dict[str, Any] = copy.deepcopy(dict(base))
        origin = "the config given in code"
    else:
        data = {}
        if path is None and env.get("HIPRESS_CONFIG"):
            path = env["HIPRESS_CONFIG"]
            origin = f"{path} (from HIPRESS_CONFIG)"
    if path is not None and base is None:
        path = os.fspath(path)
        origin = origin or path
        data = _read_yaml(path)
    sources: Dict[str, str] = {}
    env_layer = []
    for name, (key, kind) in ENV_OVERRIDES.items():
        raw = env.get(name)
        if raw:
            env_layer.append((key, _env_value(name, raw, kind), f"environment {name}"))
    _apply_layer(data, env_layer, sources)
    _apply_layer(data, [(str(k), v, "override") for k, v in (overrides or {}).items()], sources)
    return config_from_dict(data, origin=origin, sources=sources)


def _apply_layer(
    data: Dict[str, Any], layer: List[Tuple[str, Any, str]], sources: Dict[str, str]
) -> None:
    """Apply one layer of (dotted key, value, source) on top of ``data``.

    A layer that switches ``compression.algorithm`` to another codec without setting
    ``compression.params`` drops the lower layers' params: they belong to the old codec
    (``ratio`` of topk means nothing to onebit).
    """
    comp = data.get("compression")
    algorithms = [v for k, v, _ in layer if k == "compression.algorithm"]
    sets_params = any(k == "compression" or k.startswith("compression.params")
                      for k, _, _ in layer)
    if (algorithms and isinstance(comp, dict) and comp.get("params") and not sets_params
            and comp.get("algorithm", "none") != algorithms[-1]):
        logger.info("compression.algorithm %r -> %r: dropping params %r of the old codec",
                    comp.get("algorithm", "none"), algorithms[-1], comp["params"])
        del comp["params"]
    for key, value, source in layer:
        _set_dotted(data, key, value, source)
        sources[key] = source


def _human_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << (shift - 10)) == 0:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def _cycle_text(sync: SyncConfig) -> str:
    """``20-80 ms`` (the cycle and the longest cycle), or ``20 ms`` when they are equal."""
    low, high = sync.cycle_time_ms, max(sync.cycle_time_ms, sync.max_cycle_time_ms)
    return f"{low:g} ms" if high == low else f"{low:g}-{high:g} ms"


def summarize_effective(cfg: HiPressConfig, size: int, local_size: int,
                        code: Optional[Mapping[str, str]] = None) -> str:
    """Return the effective config as one line, logged at INFO by rank 0 once per job.

    Args:
        cfg: the effective config (file, environment and ``init`` overrides merged).
        size: the world size the job really runs with (not ``cluster.np``).
        local_size: ranks on rank 0's host.
        code: compression set in code, source -> codec (e.g.
            ``{"DistributedOptimizer": "dgc"}``); it overrides the policy for the
            gradients of that source.

    Example:
        ``HiPress: 2 ranks (2 on this host) | gradients: dgc (DistributedOptimizer) |
        policy: onebit, min 64 KiB, warm-up 0, memory auto, rules none | sync: auto,
        partitions 4 MiB, fusion 64 MiB, cycle 20-80 ms, stall 60 s, plan none | timeline off``
    """
    comp, sync = cfg.compression, cfg.sync
    algo = comp.algorithm + (f"{comp.params}" if comp.params else "")
    rules = ", ".join(f"{r.pattern}->{r.algorithm}" for r in comp.rules) or "none"
    parts = [f"HiPress: {size} rank{'s' if size != 1 else ''} ({local_size} on this host)"]
    if code:
        parts.append("gradients: " + ", ".join(f"{c} ({src})" for src, c in code.items()))
    parts.append(f"policy: {algo}, min {_human_bytes(comp.min_compress_bytes)}, warm-up "
                 f"{comp.warmup_steps}, memory {comp.memory}, rules {rules}")
    split = (f"{sync.partitions} partitions" if sync.partitions
             else f"partitions {_human_bytes(sync.partition_bytes)}")
    parts.append(f"sync: {sync.strategy}, {split}, fusion "
                 f"{_human_bytes(sync.fusion_threshold_bytes)}, cycle {_cycle_text(sync)}, "
                 f"stall warning {sync.stall_warning_s:g} s, shutdown "
                 f"{f'{sync.stall_shutdown_s:g} s' if sync.stall_shutdown_s else 'never'}, "
                 f"plan {sync.plan}")
    parts.append(f"timeline {cfg.timeline or 'off'}")
    return " | ".join(parts)


def dump_effective(cfg: HiPressConfig) -> str:
    """Return the effective config as indented YAML text, to be logged once (by rank 0).

    Example:
        >>> logger.info("%s", dump_effective(cfg))
    """
    body = cfg.to_yaml().rstrip("\n")
    return "effective HiPress config:\n" + "\n".join("  " + line for line in body.splitlines())
