"""A DistributedDataParallel communication hook that synchronizes gradients through HiPress.

For users who keep ``torch.nn.parallel.DistributedDataParallel``: DDP still buckets the
gradients and overlaps with backward, HiPress does the compression and the transfer::

    import hipress.torch as hp
    torch.distributed.init_process_group("gloo")       # torchrun, or hipressrun (it exports
    model = DDP(model)                                  # RANK, MASTER_ADDR, ...)
    model.register_comm_hook(hp.DDPHookState(model), hp.make_ddp_hook("powersgd", rank=1))

``make_ddp_hook`` initializes HiPress when the script has not (``hipress.init()`` with
``HIPRESS_CONFIG`` or the defaults): under ``torchrun`` it runs over DDP's default
process group (two gloo sub-groups of its own, so its traffic never mixes with DDP's),
under ``hipressrun``/``mpirun`` over MPI. Call ``hp.init(config)`` first to pass a config.

How the hook runs, per bucket:

1. Each parameter's gradient in the bucket (a view into DDP's flat bucket buffer, with
   the parameter's shape) is handed zero-copy to :func:`hipress.allreduce_async` under
   the parameter's name (``model.named_parameters()`` when the state is built from the
   model, else the bucket position and shape), with ``inplace=True`` so the result lands
   in the bucket buffer itself. Compression therefore works per parameter, as in
   PyTorch's ``powerSGD_hook``: PowerSGD sees each weight as a matrix (convolution
   kernels ``(out, in, kh, kw)`` as ``(out, in * kh * kw)``) and sends vectors
   uncompressed; ``compression.rules`` and ``min_compress_bytes`` apply to parameter
   names and sizes. Small gradients are fused by the engine as usual.
2. A torch Future is returned at once; one waiter thread per process completes it with
   the bucket buffer once every gradient of the bucket is synchronized, so buckets
   overlap each other and the rest of the backward pass. DDP waits for the futures at
   the end of backward and copies the bucket into ``p.grad``.
3. When a bucket index repeats, a new iteration has begun: :func:`hipress.step` is called
   once (warm-up counting), so DDP users do not call it themselves.

The process group itself carries no gradient traffic; it is only DDP's requirement
(parameter broadcast at construction, bucket rebuild).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Dict, List, Optional, Set

import torch

import hipress
from hipress.adapter_common import Average, check_op, resolve_codec

from .convert import from_array, shares_memory, to_array

logger = logging.getLogger(__name__)


class DDPHookState:
    """State of the HiPress DDP hook: parameter names and the iteration tracker.

    Args:
        model: the (DDP-wrapped or plain) module; its ``named_parameters()`` name the
            gradients (``fc.weight``; with a prefix ``<prefix>.fc.weight``), so
            ``compression.rules`` such as ``*.bias`` match them. None: gradients are named
            ``<prefix or "ddp">.bucket<i>.<j>.<shape>`` by their bucket position.
        prefix: prefix of the gradient names; give each DDP model of one job its own.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, prefix: str = "") -> None:
        self.prefix = prefix
        self.names: Dict[int, str] = {}
        if model is not None:
            module = getattr(model, "module", model)
            lead = f"{prefix}." if prefix else ""
            self.names = {id(p): lead + n for n, p in module.named_parameters()}
        self._seen: Set[int] = set()
        self._lock = threading.Lock()

    def gradient_name(self, bucket: Any, position: int, param: torch.Tensor) -> str:
        """Return the stable gradient name of the ``position``-th parameter of ``bucket``."""
        name = self.names.get(id(param))
        if name is None:
            shape = "x".join(map(str, param.shape)) or "s"
            name = f"{self.prefix or 'ddp'}.bucket{bucket.index()}.{position}.{shape}"
        return name

    def new_bucket(self, index: int) -> None:
        """Record a bucket; call :func:`hipress.step` when its index repeats (new iteration)."""
        with self._lock:
            if index in self._seen:
                self._seen.clear()
                hipress.step()
            self._seen.add(index)


class _Waiter:
    """One daemon thread that completes torch Futures from engine handles, in order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hipress-ddp-waiter", daemon=True)
        self._thread.start()

    def put(self, handles: List[Any], future: torch.futures.Future,
            finish: Callable[[List[Any]], torch.Tensor]) -> None:
        self._queue.put((handles, future, finish))

    def _run(self) -> None:
        while True:
            handles, future, finish = self._queue.get()
            try:
                future.set_result(finish([hipress.synchronize(h) for h in handles]))
            except BaseException as exc:  # noqa: BLE001  (handed to whoever waits)
                future.set_exception(exc)


_waiter: Optional[_Waiter] = None
_waiter_lock = threading.Lock()
_default_state: Optional[DDPHookState] = None


def _get_waiter() -> _Waiter:
    global _waiter
    with _waiter_lock:
        if _waiter is None:
            _waiter = _Waiter()
        return _waiter


def make_ddp_hook(
    compression: Any = None, op: str = Average, **codec_params: Any
) -> Callable[[Any, Any], torch.futures.Future]:
    """Return a DDP communication hook that synchronizes each parameter's gradient with HiPress.

    Args:
        compression: None (or ``"auto"``): the job's compression policy
            (``compression.algorithm``, rules on parameter names, ``min_compress_bytes``,
            warm-up); a codec name or Codec instance: that codec for every gradient,
            whatever its size (PowerSGD still sends vectors uncompressed).
        op: ``hp.Average`` (what DDP expects) or ``hp.Sum``.
        **codec_params: parameters of the named codec (e.g. ``rank=1`` for PowerSGD).

    Returns:
        ``hook(state, bucket) -> torch.futures.Future[Tensor]`` for
        ``model.register_comm_hook(state, hook)``; ``state`` is a :class:`DDPHookState`
        (pass the model so gradients are named by parameter) or None (a shared default
        state naming gradients by bucket position and shape).

    HiPress is initialized here (``hipress.init()``) if it is not yet, so a DDP script
    needs no other HiPress call: the transport follows the launcher (torchrun: DDP's
    default process group; hipressrun/mpirun: MPI).

    Raises:
        ValueError: codec parameters without a codec name, or a bad ``op``.
        CodecError: unknown codec name or bad parameters.
        ConfigError: HiPress was not initialized and ``hipress.init()`` failed (e.g. no
            launcher recognised although ``WORLD_SIZE`` says several processes).
    """
    if not hipress.is_initialized():
        hipress.init()
    return _build_hook(compression, op, codec_params)


def _build_hook(compression: Any, op: str,
                codec_params: Dict[str, Any]) -> Callable[[Any, Any], torch.futures.Future]:
    """Build :func:`make_ddp_hook`'s hook (without initializing HiPress)."""
    codec = resolve_codec(compression, codec_params, gradients=True)
    op = check_op(op)
    hipress.api.note_compression("make_ddp_hook", codec)

    # no annotations on bucket and the result: DDP compares them with the real classes
    def hook(state: Optional[DDPHookState], bucket):  # noqa: ANN001, ANN202
        global _default_state
        if state is None:
            if _default_state is None:
                _default_state = DDPHookState()
            state = _default_state
        state.new_bucket(bucket.index())
        buffer = bucket.buffer()
        grads = bucket.gradients()  # views into the bucket buffer
        arrays, handles = [], []
        for j, (grad, param) in enumerate(zip(grads, bucket.parameters())):
            array = to_array(grad)  # a view into the bucket buffer
            arrays.append(array)
            handles.append(hipress.allreduce_async(
                array, name=state.gradient_name(bucket, j, param), op=op, codec=codec,
                inplace=True))
        future: torch.futures.Future = torch.futures.Future()

        def finish(results: List[Any], _keep: Any = arrays) -> torch.Tensor:
            for grad, result in zip(grads, results):
                if not shares_memory(result, grad):  # not written in place: copy it in
                    grad.copy_(from_array(result, like=grad))
            return buffer

        _get_waiter().put(handles, future, finish)
        return future

    return hook


def ddp_comm_hook(state: Optional[DDPHookState], bucket):  # noqa: ANN001, ANN201
    """DDP communication hook following the job's compression policy (see make_ddp_hook).

    Args:
        state: a :class:`DDPHookState`, or None.
        bucket: the ``torch.distributed.GradBucket`` DDP passes.

    Returns:
        A ``torch.futures.Future`` completed with the averaged bucket buffer.

    HiPress is initialized at the first call if the script has not done so.
    """
    if not hipress.is_initialized():
        hipress.init()
    return _policy_hook(state, bucket)


_policy_hook = _build_hook(None, Average, {})
