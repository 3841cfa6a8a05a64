"""Synchronization baselines HiPress is measured against, written the way those systems work.

- :func:`horovod_allreduce` — uncompressed, tensors fused into buckets (64 MiB by
  default), one MPI ``Allreduce`` per bucket (Horovod's tensor fusion);
  :func:`gloo_allreduce` the same over ``torch.distributed`` (gloo).
- :func:`grace_allgather` — GRACE (Xu et al., ICDCS 2021) as published: per tensor,
  compress (with its residual memory), allgather the payloads, decompress each rank's copy
  and sum; synchronous, one tensor at a time.
- :func:`byteps_ps` — a parameter server that is not pipelined (BytePS's onebit path):
  per tensor, workers send the payload to the tensor's server, which decodes, sums and
  re-encodes, then sends it back; one tensor at a time, no overlap.

All take ``grads``, a dict name -> float32 NumPy array, run under MPI (mpi4py), and
return a dict name -> averaged array. Codecs come from HiPress's registry, so the
comparison isolates the synchronization strategy from codec speed.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from hipress.codecs import Payload, get_codec
from hipress.memory import get_memory


def horovod_allreduce(comm: Any, grads: Dict[str, np.ndarray],
                      fusion_bytes: int = 64 << 20) -> Dict[str, np.ndarray]:
    """Average ``grads`` with MPI Allreduce over fused buckets (Horovod tensor fusion)."""
    from mpi4py import MPI

    def reduce(buf: np.ndarray) -> None:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    return _fused_average(grads, comm.Get_size(), reduce, fusion_bytes)


def gloo_allreduce(grads: Dict[str, np.ndarray],
                   fusion_bytes: int = 64 << 20) -> Dict[str, np.ndarray]:
    """:func:`horovod_allreduce` with ``torch.distributed.all_reduce`` on the default group.

    The uncompressed baseline of the torch transport (Horovod's ``--gloo``, or DDP's
    allreduce without its bucketing overlap): needs an initialized gloo process group.
    """
    import torch
    import torch.distributed as dist

    def reduce(buf: np.ndarray) -> None:
        dist.all_reduce(torch.from_numpy(buf))

    return _fused_average(grads, dist.get_world_size(), reduce, fusion_bytes)


def _fused_average(grads: Dict[str, np.ndarray], n: int, reduce: Any,
                   fusion_bytes: int) -> Dict[str, np.ndarray]:
    """Average ``grads`` bucket by bucket (Horovod's tensor fusion).

    Concatenates the gradients into buckets of at most ``fusion_bytes``, sums each in
    place with ``reduce(buf)``, divides by ``n`` and returns the averaged views by name.
    """
    names = list(grads)
    out: Dict[str, np.ndarray] = {}
    i = 0
    while i < len(names):
        bucket: List[str] = []
        size = 0
        while i < len(names) and (not bucket or size + grads[names[i]].nbytes <= fusion_bytes):
            bucket.append(names[i])
            size += grads[names[i]].nbytes
            i += 1
        buf = np.concatenate([grads[k].reshape(-1) for k in bucket])
        reduce(buf)
        buf /= n
        pos = 0
        for k in bucket:
            m = grads[k].size
            out[k] = buf[pos:pos + m].reshape(grads[k].shape)
            pos += m
    return out


class GraceAllgather:
    """GRACE-style compress -> allgather -> decompress each -> sum, per tensor.

    Args:
        codec: codec name; params: its parameters; memory: "residual" or "none".
    """

    def __init__(self, codec: str, params: Dict[str, Any], memory: str = "residual") -> None:
        self.codec = get_codec(codec, **params)
        self.memory = get_memory(memory if self.codec.error_feedback else "none")

    def __call__(self, comm: Any, grads: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Synchronize every tensor in turn; return the averages."""
        from mpi4py import MPI

        n = comm.Get_size()
        out = {}
        for name, g in grads.items():
            c = self.memory.compensate(name, g)
            p = self.codec.encode(c, name)
            self.memory.update(name, c, self.codec.decode(p))
            buf = p.to_buffer()
            sizes = np.array(comm.allgather(buf.size), dtype=np.int64)
            allbuf = np.empty(int(sizes.sum()), np.uint8)
            displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            comm.Allgatherv(buf, [allbuf, sizes, displs, MPI.BYTE])
            acc = np.zeros(g.size, np.float32)
            for r in range(n):
                seg = allbuf[displs[r]:displs[r] + sizes[r]]
                acc += self.codec.decode(Payload.from_bytes(seg)).reshape(-1)
            out[name] = (acc / n).reshape(g.shape)
        return out


class BytePSNonPipelined:
    """Co-located PS, one tensor at a time: encode -> send -> decode+sum+encode -> send back."""

    def __init__(self, codec: str, params: Dict[str, Any], memory: str = "residual") -> None:
        self.codec = get_codec(codec, **params)
        self.memory = get_memory(memory if self.codec.error_feedback else "none")

    def __call__(self, comm: Any, grads: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Synchronize every tensor in turn; return the averages."""
        from mpi4py import MPI

        n, me = comm.Get_size(), comm.Get_rank()
        out = {}
        for i, (name, g) in enumerate(grads.items()):
            server = i % n
            c = self.memory.compensate(name, g)
            p = self.codec.encode(c, name)
            self.memory.update(name, c, self.codec.decode(p))
            buf = p.to_buffer()
            if me == server:
                acc = self.codec.decode(p).reshape(-1).astype(np.float32)
                for r in range(n):
                    if r == server:
                        continue
                    st = MPI.Status()
                    comm.Probe(source=r, tag=i, status=st)
                    rb = np.empty(st.Get_count(MPI.BYTE), np.uint8)
                    comm.Recv([rb, MPI.BYTE], source=r, tag=i)
                    acc += self.codec.decode(Payload.from_bytes(rb)).reshape(-1)
                sp = self.codec.encode(acc, name + "@server")
                sbuf = sp.to_buffer()
                for r in range(n):
                    if r != server:
                        comm.Send([sbuf, MPI.BYTE], dest=r, tag=i)
            else:
                comm.Send([buf, MPI.BYTE], dest=server, tag=i)
                st = MPI.Status()
                comm.Probe(source=server, tag=i, status=st)
                sbuf = np.empty(st.Get_count(MPI.BYTE), np.uint8)
                comm.Recv([sbuf, MPI.BYTE], source=server, tag=i)
            res = self.codec.decode(Payload.from_bytes(sbuf))
            out[name] = (res / n).reshape(g.shape)
        return out
