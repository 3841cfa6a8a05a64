"""Timeline: one Chrome-trace event per engine task, viewable in Perfetto or chrome://tracing.

Each rank records complete events (``"ph": "X"``) with the primitive as the event name
(encode, decode, merge, send, recv, negotiate, ...) and the gradient, partition, bytes and
rank as arguments; ``pid`` is the rank and ``tid`` the thread, so a user sees encode of one
partition overlapping the send of another.

The file is written as the job runs, so that a job that fails leaves a trace up to the
failure: every rank appends its events to the file (the Trace Event Format's JSON array
form, which Perfetto and chrome://tracing open without its closing bracket) at least every
:data:`FLUSH_INTERVAL_S` seconds, with one ``write`` per batch on a file opened with
``O_APPEND``, so ranks of one host never interleave inside a line; ranks on other hosts
write their own host's file of the same path. After a clean shutdown rank 0 gathers every
rank's events and replaces the file with the JSON object form plus metadata (world size,
per-gradient statistics). A rank killed by a signal loses at most its last interval.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

#: longest time an event waits in memory before it is appended to the file
FLUSH_INTERVAL_S = 0.5
_FLUSH_EVENTS = 512


class Timeline:
    """Collects trace events in memory; cheap no-ops when disabled.

    Args:
        enabled: record events (False makes every call a no-op).
        rank: recorded as the event's ``pid``.
        path: file the events are streamed to as they are recorded (see the module
            docstring), or None to keep them in memory only.
    """

    def __init__(self, enabled: bool, rank: int = 0, path: Optional[str] = None) -> None:
        self.enabled = enabled
        self.rank = rank
        self.path = path if enabled else None
        self._events: List[Dict[str, Any]] = []
        self._lock = threading.Lock()
        # timestamps: wall-clock microseconds, so that ranks line up in one trace
        self._t0 = time.perf_counter()
        self._wall0 = time.time() * 1e6
        self._pending: List[str] = []
        self._last_flush = time.monotonic()
        self._fd: Optional[int] = None

    def create_file(self) -> None:
        """Start the trace file afresh (rank 0, or every rank for per-rank paths).

        Call it before any rank writes (the engine does, before a barrier).

        Raises:
            OSError: the file cannot be created.
        """
        if self.path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        self._open()

    def now_us(self) -> float:
        """Return wall-clock microseconds (the Unix epoch, at ``perf_counter`` resolution)."""
        return self._wall0 + (time.perf_counter() - self._t0) * 1e6

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Record the enclosed block as one complete event named ``name``.

        Its ``args`` also get ``cpu_us``: the CPU time the recording thread spent in the
        block, microseconds (``dur`` minus ``cpu_us`` is time the thread waited or was
        preempted; SeCoPa's refit separates the engine's own overhead with it).
        """
        if not self.enabled:
            yield
            return
        start = self.now_us()
        cpu0 = time.thread_time_ns()
        try:
            yield
        finally:
            args["cpu_us"] = round((time.thread_time_ns() - cpu0) * 1e-3, 3)
            self.add(name, start, self.now_us() - start, **args)

    def add(self, name: str, start_us: float, dur_us: float, **args: Any) -> None:
        """Record a complete event that started at ``start_us`` and lasted ``dur_us``."""
        if not self.enabled:
            return
        ev = {
            "name": name,
            "cat": args.pop("cat", "hipress"),
            "ph": "X",
            "ts": round(start_us, 3),
            "dur": round(max(dur_us, 0.0), 3),
            "pid": self.rank,
            "tid": threading.current_thread().name,
            "args": args,
        }
        with self._lock:
            self._events.append(ev)
            if self.path is None:
                return
            self._pending.append(json.dumps(ev))
            due = (len(self._pending) >= _FLUSH_EVENTS
                   or time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S)
        if due:
            self.flush()

    def events(self) -> List[Dict[str, Any]]:
        """Return a copy of the recorded events."""
        with self._lock:
            return list(self._events)

    def record_in_memory(self, on: bool) -> None:
        """Record events in memory only (``on``), or stop and drop them (``on`` False).

        For a timeline that is off (no ``timeline:`` path): SeCoPa's ``sync.plan: auto``
        records a few steps this way to plan from. A timeline with a file is left as it
        is (its events are kept and written).
        """
        if self.path is not None:
            return
        with self._lock:
            self.enabled = bool(on)
            if not on:
                self._events = []

    def maybe_flush(self) -> None:
        """Flush if the oldest unwritten event has waited :data:`FLUSH_INTERVAL_S` (cheap)."""
        if self._pending and time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        """Append the events not yet on disk to the file (one ``write``); never raises."""
        if self.path is None:
            return
        with self._lock:
            lines, self._pending = self._pending, []
            self._last_flush = time.monotonic()
            if not lines:
                return
            try:
                if self._fd is None:
                    self._open()
                assert self._fd is not None
                os.write(self._fd, "".join(line + ",\n" for line in lines).encode())
            except OSError:
                self.path = None  # a full disk must not end the job; stop writing

    def _open(self) -> None:
        """Open the file for appending; whoever creates it writes the array's ``[``."""
        assert self.path is not None
        head = json.dumps({"name": "process_name", "ph": "M", "pid": self.rank,
                           "args": {"name": f"rank {self.rank}"}}) + ",\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
            head = "[\n" + head
        except FileExistsError:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        os.write(fd, head.encode())
        self._fd = fd

    def close(self) -> None:
        """Flush and close the file."""
        self.flush()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def write_trace(path: str, per_rank_events: List[List[Dict[str, Any]]],
                metadata: Optional[Dict[str, Any]] = None) -> None:
    """Write events of all ranks as one Chrome-trace JSON file at ``path`` (atomically)."""
    events: List[Dict[str, Any]] = []
    for rank, evs in enumerate(per_rank_events):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.extend(evs)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": metadata or {}}, f)
    os.replace(tmp, path)
