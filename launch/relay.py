"""Run an MPI command: relay its output with rank prefixes, report the rank that failed.

The thin exec half of the launcher. :func:`run_job` starts ``mpirun`` in its own session,
copies its stdout and stderr line by line (rewriting Open MPI's ``[1,R]<stdout>: `` tag
into ``[R] ``), forwards SIGINT/SIGTERM/SIGHUP to it, and when the job fails names the
rank from ``mpirun``'s own report.

What stops a failed job: Open MPI's ``mpirun`` terminates every rank as soon as one exits
non-zero (or is killed) and exits with that rank's status, within about a second. On a
signal to ``hipressrun`` the same signal goes to ``mpirun``, which terminates the job; if
it has not finished ``grace_s`` seconds later (or on a second signal), its process group
is killed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import IO, Any, Deque, List, Mapping, Optional, Sequence

__all__ = ["Causes", "describe_failure", "rewrite_tag", "run_job"]

logger = logging.getLogger(__name__)

_OMPI_TAG = re.compile(rb"^\[\d+,(\d+)\]<\w+>: ?")
_MPICH_TAG = re.compile(rb"^\[(\d+)\] ")  # Hydra's -prepend-rank
_TORCH_RANK = re.compile(r"^\[rank\d+\]: ")  # torch.distributed prefixes stderr lines
_FAILURES = (
    # Open MPI 4/5: "...exited with non-zero status... Process name: [prterun-x@1,2]
    #                Exit code:    1"
    (re.compile(r"Process name:\s*\[[^\]]*?,(\d+)\]\s*Exit code:\s*(-?\d+)"), "exit code"),
    # Open MPI 5 (prterun) and 4 (mpirun), a rank that exits, even with status 0, after
    # MPI_Init but without MPI_Finalize (os._exit): "prterun has exited due to process rank
    # 1 with PID 7559 on node vm exiting improperly."
    (re.compile(r"process\s+rank\s+([0-9]+)\s+with\s+PID\s+[0-9]+\s+on\s+node\s+\S+\s+exiting"
                r"\s+improperly"), "improper"),
    # Open MPI: "process rank 0 with PID 5699 on node vm exited on signal 9 (Killed)."
    (re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)"),
     "signal"),
    # MPICH Hydra: "RANK 2 PID 123 RUNNING AT host\n=   EXIT CODE: 1"
    (re.compile(r"RANK (\d+) PID \d+ RUNNING AT \S+\s*=*\s*EXIT (?:CODE|STATUS):\s*(\d+)"),
     "exit code"),
    (re.compile(r"RANK (\d+) PID \d+ RUNNING AT \S+\s*=*\s*KILLED BY SIGNAL:\s*(\d+)"),
     "signal"),
)


def rewrite_tag(line: bytes) -> bytes:
    """Rewrite Open MPI's ``[1,R]<stdout>: text`` into ``[R] text``; other lines unchanged."""
    return _OMPI_TAG.sub(rb"[\1] ", line, count=1)


def describe_failure(untagged_output: str) -> Optional[str]:
    """Return which rank failed and how, from the launcher's own report, or None.

    Returns:
        ``"rank R failed (exit code N)"``, ``"rank R failed (signal N)"``, or ``"rank R
        failed (exited early without finalizing MPI: ...)"`` for a rank that ended after
        ``MPI_Init`` without ``MPI_Finalize``, whatever its status (``os._exit()``, or a
        rank that finished while others still waited for its gradients); None when the
        output names no rank.
    """
    for pattern, what in _FAILURES:
        m = pattern.search(untagged_output)
        if m and what == "improper":
            return (f"rank {m.group(1)} failed (exited early without finalizing MPI: "
                    "os._exit(), or it finished while others still waited for it)")
        if m:
            return f"rank {m.group(1)} failed ({what} {m.group(2)})"
    return None


class Causes:
    """The last exception line each rank printed (a Python traceback's final line).

    Fed with every tagged output line; a line that follows ``Traceback (most recent call
    last):`` and is not indented ends the traceback and is that rank's exception (chained
    tracebacks end with the final one). A ``[hipress ERROR]`` line counts when a rank
    printed no traceback (e.g. a rank that finished while others waited for it).
    """

    def __init__(self) -> None:
        self.last: dict = {}
        self._errors: dict = {}
        self._in_tb: set = set()
        self._lock = threading.Lock()

    def feed(self, rank: int, text: str, stream: str = "stderr") -> None:
        """Take one output line of ``rank`` (without its tag) from ``stream``."""
        text = _TORCH_RANK.sub("", text.rstrip("\n"), count=1)  # torch.distributed's prefix
        key = (rank, stream)  # stdout and stderr arrive interleaved: follow each alone
        with self._lock:
            if text.startswith("Traceback (most recent call last):"):
                self._in_tb.add(key)
            elif key in self._in_tb and text and not text[0].isspace():
                if not text.startswith(("During handling", "The above exception")):
                    self.last[rank] = text
                    self._in_tb.discard(key)
            elif "[hipress ERROR]" in text:
                self._errors[rank] = text.split("[hipress ERROR]", 1)[1].strip()

    def of(self, rank: int) -> Optional[str]:
        """Return the cause ``rank`` printed last (its exception, else its HiPress error)."""
        with self._lock:
            text = self.last.get(rank) or self._errors.get(rank)
        if text and len(text) > 300:
            text = text[:297] + "..."
        return text


class _Pump(threading.Thread):
    """Copy one pipe to a stream line by line, rewriting rank tags; keep untagged lines."""

    def __init__(self, src: IO[bytes], dst: Any, keep: Optional[Deque[str]],
                 causes: Optional[Causes] = None, stream: str = "stderr") -> None:
        super().__init__(daemon=True)
        self.src, self.dst, self.keep, self.causes = src, dst, keep, causes
        self.stream = stream

    def run(self) -> None:
        out = getattr(self.dst, "buffer", self.dst)
        for line in iter(self.src.readline, b""):
            m = _OMPI_TAG.match(line)
            tagged = m is not None
            new = rewrite_tag(line) if tagged else line
            rank_tag = m or _MPICH_TAG.match(line)
            if self.causes is not None and rank_tag is not None:
                self.causes.feed(int(rank_tag.group(1)),
                                 line[rank_tag.end():].decode("utf-8", "replace"), self.stream)
            if self.keep is not None and not tagged:
                self.keep.append(line.decode("utf-8", "replace"))
            try:
                out.write(new)
                out.flush()
            except (OSError, ValueError):  # our own stdout closed: keep draining the pipe
                pass
        self.src.close()


def run_job(
    argv: Sequence[str],
    env: Mapping[str, str],
    grace_s: float = 10.0,
    stdout: Any = None,
    stderr: Any = None,
) -> int:
    """Run the MPI command to completion and return hipressrun's exit status.

    Steps:
        1. start ``argv`` (no shell) in a new session with ``env``, stdin from /dev/null;
        2. relay stdout/stderr line by line, rewriting rank tags;
        3. on SIGINT/SIGTERM/SIGHUP: send the same signal to ``mpirun``; a second signal,
           or ``grace_s`` seconds without exit, kills its process group;
        4. on a non-zero exit, print which rank failed (parsed from ``mpirun``'s report).

    Args:
        argv: the full command from a runner's ``get_cmd``.
        env: the complete environment for ``mpirun``.
        grace_s: seconds to wait after forwarding a signal before killing.
        stdout: where rank stdout goes (default ``sys.stdout``).
        stderr: where rank stderr and our messages go (default ``sys.stderr``).

    Returns:
        0 on success; ``mpirun``'s status when the job failed; 128 + signal number when
        it was stopped by a signal. The failure message names the rank and quotes the
        last exception it printed (see :class:`Causes`).
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    proc = subprocess.Popen(
        list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )
    untagged: Deque[str] = deque(maxlen=400)
    causes = Causes()
    pumps = [_Pump(proc.stdout, stdout, None, causes, "stdout"),
             _Pump(proc.stderr, stderr, untagged, causes, "stderr")]
    for p in pumps:
        p.start()

    got: List[int] = []
    deadline = [float("inf")]

    def _kill_group() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _on_signal(signum: int, frame: Any) -> None:
        got.append(signum)
        if len(got) == 1:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass
            deadline[0] = time.monotonic() + grace_s
        else:
            _kill_group()

    handled = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in handled:
            previous[s] = signal.signal(s, _on_signal)
    try:
        while True:
            try:
                proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline[0]:
                    _kill_group()
                    deadline[0] = float("inf")
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    for p in pumps:
        p.join(timeout=5.0)

    rc = proc.returncode
    message = None
    if got:
        message = f"stopped by signal {got[0]}; the job was terminated"
        rc = 128 + got[0]
    elif rc != 0:
        who = describe_failure("".join(untagged))
        status = f"signal {-rc}" if rc < 0 else f"status {rc}"
        if who:
            m = re.match(r"rank (\d+)", who)
            cause = causes.of(int(m.group(1))) if m else None
            who += f": {cause}" if cause else ""
            message = f"{who}; mpirun stopped the other ranks and exited with {status}"
        else:
            message = f"the job failed: mpirun exited with {status} without naming the rank"
        rc = 128 - rc if rc < 0 else rc
    if message:
        try:
            stderr.write(f"hipressrun: {message}\n")
            stderr.flush()
        except (OSError, ValueError):
            pass
    return rc
