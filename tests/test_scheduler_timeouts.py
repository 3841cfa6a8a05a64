"""The scheduler: its stall bound times communication, not local compute; a stopped pool.

A compute step (encode, decode, merge) that is slow because the CPU is loaded is
progress; only a send or receive that a peer never completes is a stalled rank. A CI
run on a loaded machine once failed a healthy job with "waited 3.2 s for compute".
"""

from __future__ import annotations

import time

import pytest

from hipress.engine.scheduler import Compute, Recv, Scheduler
from hipress.errors import SyncError


class _NeverTransport:
    """A transport whose receives never complete (a hung peer)."""

    def begin_batch(self):
        pass

    def end_batch(self):
        pass

    def irecv(self, buf, src, tag):
        return object()

    def test_some(self, reqs):
        return []


def _drive(sched, seconds):
    end = time.monotonic() + seconds
    while sched.busy and time.monotonic() < end:
        sched.poll()
        time.sleep(0.01)


def test_slow_compute_is_not_a_stall():
    sched = Scheduler(_NeverTransport(), compute_threads=1, wait_timeout_s=0.2)
    got = []

    def task():
        got.append((yield Compute(lambda: time.sleep(1.0) or 42)))

    sched.add(task(), "slow")
    try:
        _drive(sched, 5.0)
    finally:
        sched.shutdown()
    assert got == [42]
    assert not sched.busy


def test_receive_that_never_completes_names_the_peer():
    sched = Scheduler(_NeverTransport(), compute_threads=1, wait_timeout_s=0.2)

    def task():
        yield Recv(src=3, tag=7, nbytes=16)

    sched.add(task(), "grad.0#p0")
    t0 = time.monotonic()
    try:
        with pytest.raises(SyncError, match=r"grad\.0#p0 waited .* for recv with rank\(s\) \[3\]"):
            _drive(sched, 5.0)
    finally:
        sched.shutdown()
    assert time.monotonic() - t0 < 2.0


def test_a_stopped_compute_pool_is_a_quiet_sync_error():
    """Interpreter exit stops the pool under a running engine (a CI run saw its traceback
    named as the failing rank's cause instead of the script's own exception)."""
    sched = Scheduler(_NeverTransport(), compute_threads=1, wait_timeout_s=5.0)
    sched.pool.shutdown(wait=True)

    def task():
        yield Compute(lambda: 1)

    with pytest.raises(SyncError, match="the compute pool has stopped .*process is exiting"):
        sched.add(task(), "late")


def test_inline_compute_error_is_raised_from_poll():
    """compute_threads=0: a failing compute step surfaces from poll(), not from add().

    The engine catches errors of poll() to tell every rank before it stops; an error
    raised from add() (inside a negotiation round) would end this rank alone.
    """
    def boom():
        raise RuntimeError("boom")

    def task():
        yield Compute(boom, ())

    sched = Scheduler(_NeverTransport(), compute_threads=0, wait_timeout_s=5.0)
    sched.add(task(), "t")  # does not raise
    assert sched.busy
    with pytest.raises(RuntimeError, match="boom"):
        sched.poll()


def test_inline_compute_result_continues_at_once():
    def task(out):
        out.append((yield Compute(lambda: 41 + 1, ())))

    got = []
    sched = Scheduler(_NeverTransport(), compute_threads=0, wait_timeout_s=5.0)
    sched.add(task(got), "t")
    assert got == [42] and not sched.busy
