"""A DistributedDataParallel communication hook that synchronizes buckets through HiPress.

For users who keep ``torch.nn.parallel.DistributedDataParallel``: DDP still buckets the
gradients and overlaps with backward, HiPress does the compression and the transfer::

    import hipress.torch as hp
    hp.init()
    torch.distributed.init_process_group("gloo")       # DDP needs a process group
    model = DDP(model)
    model.register_comm_hook(hp.DDPHookState(model), hp.make_ddp_hook("onebit"))

How the hook runs, per bucket:

1. The bucket's flat gradient buffer is handed zero-copy to :func:`hipress.allreduce_async`
   under a name built from the bucket index and its parameters (their names when the state
   is a :class:`DDPHookState`, else their shapes), stable across iterations and ranks; a
   bucket whose content changes (DDP rebuilds buckets after the first iteration) gets a
   new name, so no residual is shared between different tensors.
2. A torch Future is returned at once; one waiter thread per process completes it with
   the averaged bucket when the engine is done, so buckets overlap each other and the
   rest of the backward pass. DDP waits for the futures at the end of backward.
3. When a bucket index repeats, a new iteration has begun: :func:`hipress.step` is called
   once (warm-up counting), so DDP users do not call it themselves.

The process group itself carries no gradient traffic; it is only DDP's requirement
(parameter broadcast at construction, bucket rebuild). After the hook, DDP copies the
bucket into ``p.grad``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from typing import Any, Callable, Dict, Optional, Set

import torch

import hipress
from hipress.adapter_common import Average, check_op, resolve_codec

from .convert import from_array, to_array

logger = logging.getLogger(__name__)


class DDPHookState:
    """State of the HiPress DDP hook: parameter names and the iteration tracker.

    Args:
        model: the (DDP-wrapped or plain) module; its ``named_parameters()`` name the
            buckets. None: buckets are named by their parameters' shapes.
        prefix: prefix of the gradient names (change it when two DDP models share a job).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, prefix: str = "ddp") -> None:
        self.prefix = prefix
        self.names: Dict[int, str] = {}
        if model is not None:
            module = getattr(model, "module", model)
            self.names = {id(p): n for n, p in module.named_parameters()}
        self._seen: Set[int] = set()
        self._lock = threading.Lock()

    def bucket_name(self, bucket: Any) -> str:
        """Return the stable gradient name of a DDP ``GradBucket``."""
        params = bucket.parameters()
        ident = ";".join(self.names.get(id(p), "x".join(map(str, p.shape)) or "s") for p in params)
        digest = hashlib.sha1(ident.encode()).hexdigest()[:12]
        return f"{self.prefix}.bucket{bucket.index()}.{len(params)}p.{digest}"

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

    def put(self, handle: Any, future: torch.futures.Future, convert: Callable) -> None:
        self._queue.put((handle, future, convert))

    def _run(self) -> None:
        while True:
            handle, future, convert = self._queue.get()
            try:
                future.set_result(convert(hipress.synchronize(handle)))
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
    """Return a DDP communication hook that synchronizes buckets with HiPress.

    Args:
        compression: codec name, Codec instance, or None (config policy).
        op: ``hp.Average`` (what DDP expects) or ``hp.Sum``.
        **codec_params: parameters of the named codec.

    Returns:
        ``hook(state, bucket) -> torch.futures.Future[Tensor]`` for
        ``model.register_comm_hook(state, hook)``; ``state`` is a :class:`DDPHookState`
        or None (a shared default state naming buckets by shapes).
    """
    codec = resolve_codec(compression, codec_params)
    op = check_op(op)

    # no annotations on bucket and the result: DDP compares them with the real classes
    def hook(state: Optional[DDPHookState], bucket):  # noqa: ANN001, ANN202
        global _default_state
        if state is None:
            if _default_state is None:
                _default_state = DDPHookState()
            state = _default_state
        state.new_bucket(bucket.index())
        buffer = bucket.buffer()
        array = to_array(buffer)
        handle = hipress.allreduce_async(
            array, name=state.bucket_name(bucket), op=op, codec=codec
        )
        future: torch.futures.Future = torch.futures.Future()

        def convert(result: Any, _keep: Any = array) -> torch.Tensor:
            return from_array(result, like=buffer)

        _get_waiter().put(handle, future, convert)
        return future

    return hook


def ddp_comm_hook(state: Optional[DDPHookState], bucket):  # noqa: ANN001, ANN201
    """DDP communication hook using the configured compression policy (see make_ddp_hook).

    Args:
        state: a :class:`DDPHookState`, or None.
        bucket: the ``torch.distributed.GradBucket`` DDP passes.

    Returns:
        A ``torch.futures.Future`` completed with the averaged bucket tensor.
    """
    return _policy_hook(state, bucket)


_policy_hook = make_ddp_hook()
