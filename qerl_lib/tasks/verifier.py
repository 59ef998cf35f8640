"""math-verify under a hard wall-clock limit: a killable worker process (`MathVerifier`).

Why a worker process
--------------------
math-verify's own time limit is ``signal.alarm``: whole seconds, main thread only (it raises
ValueError elsewhere), and a signal handler only runs between Python bytecodes, so it cannot stop a
C-level big-integer power: given ``10**10**10**10`` or ``2^2^2^2^2^2^2^2`` as plain text,
``verify`` was still computing when we stopped it after 10 s. A separate process can always be
killed.

How it works
------------
* One warm worker started with ``python -c`` (so nothing of the parent's ``__main__`` is
  re-imported). It reads one JSON request per line (``{"id", "gold", "pred"}``) and writes one
  reply per line (``{"id", "equal"}``); stray prints go to stderr so they cannot corrupt the stream.
* A reader thread moves reply lines into a queue; the caller waits on the queue with the time
  limit. On timeout (or a dead worker) the worker is killed and a fresh one is started at once, in
  the background, so its imports overlap with the caller's work. Replies carry the request id, so
  a stale line from a killed request can never be taken for the current answer.
* Both answers are wrapped as ``$...$`` before parsing: bare ``2^{3}`` would otherwise be read as
  ``2``, and ``18 or 19`` as whichever number math-verify's text extractor meets first.
* Orphan guards: the worker caps its own address space (default 2 GiB) and CPU time per request
  (SIGXCPU), so a worker left computing after its parent died ends by itself.
* Model output is never ``eval``'ed: math-verify parses LaTeX/sympy text.

Everything is serialised by a lock and works from any thread (the limit is not signal-based).
This module is ground floor: it imports nothing of the kit. `qerl_lib.tasks.rewards` uses it for answers
that are not plain numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import weakref

DEFAULT_TIMEOUT_S = 2.0  # wall-clock limit for one math-verify comparison

# The worker, run as `python -c`. It reads one JSON request per line and answers one per line.
# math-verify's own signal timeout is off (timeout None): the parent enforces the limit by killing.
_WORKER_SOURCE = r"""
import json, logging, sys
protocol, sys.stdout = sys.stdout, sys.stderr  # stray prints must not corrupt the protocol stream
logging.disable(logging.WARNING)  # math-verify warns that its own timeout is off: that is intended
try:
    import resource
    memory_bytes, cpu_budget_s = int(sys.argv[1]) * 2**20, int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGXCPU kill must not write a core file
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
except (ImportError, ValueError, OSError):
    resource = None
def cpu_budget():  # bound CPU time per request, so a worker orphaned mid-computation dies by itself
    if resource is not None:
        usage, hard = resource.getrusage(resource.RUSAGE_SELF), resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = int(usage.ru_utime + usage.ru_stime + cpu_budget_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
try:
    from math_verify import parse, verify
except Exception as exc:
    protocol.write(json.dumps({"ready": False, "error": repr(exc)}) + "\n"); protocol.flush(); sys.exit(1)
protocol.write(json.dumps({"ready": True}) + "\n"); protocol.flush()
for line in sys.stdin:
    request = json.loads(line)
    cpu_budget()
    try:
        gold = parse(request["gold"], parsing_timeout=None)
        pred = parse(request["pred"], parsing_timeout=None)
        equal = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
        reply = {"id": request["id"], "equal": equal}
    except Exception as exc:  # MemoryError from the address-space cap lands here too
        reply = {"id": request["id"], "equal": False, "error": repr(exc)[:300]}
    protocol.write(json.dumps(reply) + "\n"); protocol.flush()
"""

_MAX_REQUEST_CHARS = 20_000  # far above any real answer pair; score_answer caps answers well below


def _latex_for_parse(answer: str) -> str:
    # Wrap in $...$ so math-verify reads the whole answer as LaTeX: bare "2^{3}" would otherwise be
    # read as "2", and "18 or 19" as whichever number its text extractor meets.
    inner = re.sub(r"(?<!\\)\$", "", answer)
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        inner = inner.replace(delim, "")
    return f"${inner.strip()}$"


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    with contextlib.suppress(OSError):
        proc.stdin.close()  # stdout belongs to the reader thread, which closes it at end of stream


def _pump_lines(stream, replies: queue.Queue) -> None:
    try:
        for line in iter(stream.readline, ""):
            replies.put(json.loads(line))
    except (OSError, ValueError):  # stream closed under us, or a garbled line: treat as a crash
        pass
    finally:
        replies.put(None)  # end of stream: the worker exited or was killed
        stream.close()


class MathVerifier:
    """math-verify equivalence under a hard wall-clock limit, safe from any thread.

    One warm worker process; calls are serialised by a lock (waiting for the lock is not counted in
    the limit, restarting the worker after a timeout is not either: it happens in the background
    and is awaited up to `startup_timeout_s`). Counters: `calls`, `timeouts`, `crashes` (worker
    died), `worker_errors` (math-verify raised; scored not equal).
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, *, startup_timeout_s: float = 120.0,
                 memory_limit_mb: int = 2048):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0 seconds, got {startup_timeout_s}")
        if memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb must be >= 0 (0 = no cap), got {memory_limit_mb}")
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.memory_limit_mb = int(memory_limit_mb)
        self.calls = self.timeouts = self.crashes = self.worker_errors = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue | None = None
        self._finalizer: weakref.finalize | None = None
        self._owner_pid, self._ready, self._next_id = -1, False, 0

    def __getstate__(self) -> dict:  # a pickled copy (e.g. in another process) starts its own worker
        return {"timeout_s": self.timeout_s, "startup_timeout_s": self.startup_timeout_s,
                "memory_limit_mb": self.memory_limit_mb}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def start(self) -> None:
        """Start the worker and wait until math-verify is imported (optional: the first call does it)."""
        with self._lock:
            self._ensure_ready()

    def close(self) -> None:
        """Stop the worker; a later call starts a new one."""
        with self._lock:
            self._discard_worker()

    def equivalent(self, gold: str, pred: str, *, timeout_s: float | None = None) -> bool:
        """math-verify's ``verify(parse(gold), parse(pred))`` on both wrapped as ``$...$``; False on
        timeout (the worker is killed and restarted), on a crash, or when either side does not parse."""
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        if not limit > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if len(gold) + len(pred) > _MAX_REQUEST_CHARS:
            raise ValueError(f"answers too long for the verifier ({len(gold) + len(pred)} characters, "
                             f"max {_MAX_REQUEST_CHARS}): cap the answer length before calling")
        with self._lock:
            self._ensure_ready()
            self.calls += 1
            self._next_id += 1
            reply = self._exchange({"id": self._next_id, "gold": _latex_for_parse(gold),
                                    "pred": _latex_for_parse(pred)}, limit)
            if reply is None:  # timed out or died: kill it and start a fresh worker now
                self._restart()
                return False
            self.worker_errors += "error" in reply
            return bool(reply.get("equal"))

    # -- worker lifecycle (callers hold self._lock) --------------------------------------------------

    def _exchange(self, request: dict, limit: float) -> dict | None:
        """Send one request; its reply, or None (counted) when the worker is too slow or gone."""
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except OSError:  # BrokenPipeError: the worker is gone
            self.crashes += 1
            return None
        deadline = time.monotonic() + limit
        while True:
            try:
                reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.timeouts += 1
                return None
            if reply is None:
                self.crashes += 1
                return None
            if reply.get("id") == request["id"]:  # anything else is a stale line: skip it
                return reply

    def _spawn(self) -> None:
        cpu_budget_s = max(10, int(10 * self.timeout_s))  # orphan guard only; the parent kills far sooner
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_SOURCE, str(self.memory_limit_mb), str(cpu_budget_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8",
            start_new_session=True)  # a terminal Ctrl-C should interrupt the trainer, not kill the worker
        self._replies = queue.Queue()
        threading.Thread(target=_pump_lines, args=(proc.stdout, self._replies), daemon=True,
                         name="math-verify-reader").start()
        self._proc, self._owner_pid, self._ready = proc, os.getpid(), False
        self._finalizer = weakref.finalize(self, _stop_process, proc)

    def _discard_worker(self) -> None:
        if self._proc is not None and self._owner_pid == os.getpid() and self._finalizer is not None:
            self._finalizer()  # kills and reaps; a worker inherited through fork belongs to the parent
        self._proc, self._replies, self._finalizer, self._ready = None, None, None, False

    def _restart(self) -> None:
        # Kill now and start the replacement at once, so its imports overlap with the caller's work.
        self._discard_worker()
        self._spawn()

    def _ensure_ready(self) -> None:
        if self._proc is None or self._owner_pid != os.getpid():
            self._discard_worker()
            self._spawn()
        if self._ready:
            return
        try:
            hello = self._replies.get(timeout=self.startup_timeout_s)
        except queue.Empty:
            hello = {"ready": False, "error": f"no answer within {self.startup_timeout_s:.0f} s"}
        if not hello or not hello.get("ready"):
            self._discard_worker()
            why = (hello or {}).get("error", "worker exited")
            raise RuntimeError(f"math-verify worker failed to start ({why}): check that math-verify is "
                               f"installed for {sys.executable}")
        self._ready = True


_shared: MathVerifier | None = None
_shared_lock = threading.Lock()


def shared_verifier() -> MathVerifier:
    """The process-wide verifier used when none is passed (started on first use, default limit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MathVerifier()
        return _shared
