"""Timeline: one Chrome-trace event per engine task, viewable in Perfetto or chrome://tracing.

Each rank records complete events (``"ph": "X"``) with the primitive as the event name
(encode, decode, merge, send, recv, negotiate, ...) and the gradient, partition, bytes and
rank as arguments; ``pid`` is the rank and ``tid`` the thread, so a user sees encode of one
partition overlapping the send of another. At shutdown rank 0 gathers every rank's events
and writes one JSON file (the Trace Event Format's JSON object form).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Dict, Iterator, List, Optional


class Timeline:
    """Collects trace events in memory; cheap no-ops when disabled.

    Args:
        enabled: record events (False makes every call a no-op).
        rank: recorded as the event's ``pid``.
    """

    def __init__(self, enabled: bool, rank: int = 0) -> None:
        self.enabled = enabled
        self.rank = rank
        self._events: List[Dict[str, Any]] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def now_us(self) -> float:
        """Return microseconds since the timeline started."""
        return (time.perf_counter() - self._t0) * 1e6

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Record the enclosed block as one complete event named ``name``."""
        if not self.enabled:
            yield
            return
        start = self.now_us()
        try:
            yield
        finally:
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

    def events(self) -> List[Dict[str, Any]]:
        """Return a copy of the recorded events."""
        with self._lock:
            return list(self._events)


def write_trace(path: str, per_rank_events: List[List[Dict[str, Any]]],
                metadata: Optional[Dict[str, Any]] = None) -> None:
    """Write events of all ranks as one Chrome-trace JSON file at ``path``."""
    events: List[Dict[str, Any]] = []
    for rank, evs in enumerate(per_rank_events):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.extend(evs)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": metadata or {}}, f)
