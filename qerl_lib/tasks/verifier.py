"""math-verify under a hard wall-clock limit, many answers at once (`MathVerifier`).

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
  re-imported) imports math-verify once. It reads one JSON request per line
  (``{"id", "gold", "pred", "limit"}``) and, for each, **forks a child** that does the comparison
  and writes the reply into a pipe. Children run side by side (up to ``max_parallel``; more wait
  in line), and the worker kills each child when its own limit runs out and answers
  ``{"id", "equal": false, "timeout": true}``. So a batch of N pathological answers ends after
  about one limit, not N limits, and a killed child costs no re-import: the warm worker stays.
* The parent writes a batch's requests at once (`equivalent_many`), a reader thread hands each
  reply line to the caller waiting for that id, and the caller waits until its replies are in.
  Replies carry the request id, so a stale line can never be taken for another answer. If the
  worker itself stops answering (a guard of ``limit x ceil(in flight / max_parallel) + 1 s``), or
  dies, the parent kills its whole process group (worker and children) and starts a fresh worker
  at once, in the background.
* Both answers are wrapped as ``$...$`` before parsing: bare ``2^{3}`` would otherwise be read as
  ``2``, and ``18 or 19`` as whichever number math-verify's text extractor meets first.
* Orphan guards: the worker caps its address space (default 2 GiB; children inherit the cap) and
  each child its own CPU time (SIGXCPU), and the worker kills its children and exits when its
  input closes, so nothing keeps computing after the parent died.
* Without ``os.fork`` (Windows) the worker compares one answer at a time and the parent's guard
  is the only limit, so there a batch of slow answers takes one limit each.
* Model output is never ``eval``'ed: math-verify parses LaTeX/sympy text.

Any number of threads may call at once; their requests share the worker's children.
This module is ground floor: it imports nothing of the kit. `qerl_lib.tasks.rewards` uses it for
answers whose gold is not a plain number.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import weakref

DEFAULT_TIMEOUT_S = 2.0  # wall-clock limit for one math-verify comparison
DEFAULT_MAX_PARALLEL = 8  # children comparing at once (each may hold up to memory_limit_mb)
_GUARD_GRACE_S = 1.0  # the parent's slack over the worker's own per-child limit

# The worker, run as `python -c`. It reads one JSON request per line and answers one per line.
# math-verify's own signal timeout is off (timeout None): the worker enforces the limit by killing.
_WORKER_SOURCE = r"""
import collections, json, logging, os, select, signal, sys, time
protocol, sys.stdout = sys.stdout, sys.stderr  # stray prints must not corrupt the protocol stream
logging.disable(logging.WARNING)  # math-verify warns that its own timeout is off: that is intended
memory_mb, cpu_budget_s, max_parallel = (int(a) for a in sys.argv[1:4])
try:
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGXCPU kill must not write a core file
    if memory_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
except (ImportError, ValueError, OSError):
    resource = None
def cpu_budget():  # bound this process's CPU time from now on, so an orphan ends by itself
    if resource is not None:
        usage, hard = resource.getrusage(resource.RUSAGE_SELF), resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = int(usage.ru_utime + usage.ru_stime + cpu_budget_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
try:
    from math_verify import parse, verify
except Exception as exc:
    protocol.write(json.dumps({"ready": False, "error": repr(exc)}) + "\n"); protocol.flush(); sys.exit(1)
def send(reply):
    protocol.write(json.dumps(reply) + "\n"); protocol.flush()
def check(request):
    try:
        gold = parse(request["gold"], parsing_timeout=None)
        pred = parse(request["pred"], parsing_timeout=None)
        return {"id": request["id"], "equal": bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))}
    except Exception as exc:  # MemoryError from the address-space cap lands here too
        return {"id": request["id"], "equal": False, "error": repr(exc)[:300]}
forking = hasattr(os, "fork")
send({"ready": True, "parallel": max_parallel if forking else 1})
if not forking:  # one at a time; the parent's guard is the only limit
    for line in sys.stdin:
        cpu_budget(); send(check(json.loads(line)))
    sys.exit(0)
children, waiting, pending_bytes, stdin_fd = {}, collections.deque(), b"", sys.stdin.fileno()
def reap(fd, reply, kill=False):
    pid = children.pop(fd)[0]
    if kill:
        os.kill(pid, signal.SIGKILL)
    os.close(fd)
    os.waitpid(pid, 0)
    send(reply)
while True:
    while waiting and len(children) < max_parallel:
        request = waiting.popleft()
        cpu_budget()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compare, write one reply, leave without any cleanup of the parent's
            try:
                os.close(read_fd)
                os.close(protocol.fileno())  # so the parent sees end of stream as soon as the worker dies
                cpu_budget()
                os.write(write_fd, json.dumps(check(request)).encode())
            finally:
                os._exit(0)
        os.close(write_fd)
        children[read_fd] = [pid, request["id"], time.monotonic() + float(request["limit"]), b""]
    wait_s = max(0.0, min(c[2] for c in children.values()) - time.monotonic()) if children else None
    readable = select.select([stdin_fd, *children], [], [], wait_s)[0]
    for fd in readable:
        if fd == stdin_fd:
            data = os.read(stdin_fd, 1 << 16)
            if not data:  # the parent closed our input or died: stop everything
                for pid, *_ in children.values():
                    os.kill(pid, signal.SIGKILL)
                sys.exit(0)
            *lines, pending_bytes = (pending_bytes + data).split(b"\n")
            waiting.extend(json.loads(line) for line in lines if line.strip())
            continue
        chunk = os.read(fd, 1 << 16)
        if chunk:
            children[fd][3] += chunk
            continue
        request_id, out = children[fd][1], children[fd][3]
        try:
            reply = json.loads(out)
        except ValueError:  # died without a reply: SIGXCPU, a crash in C code
            reply = {"id": request_id, "equal": False, "crash": True}
        reap(fd, reply)
    now = time.monotonic()
    for fd, (pid, request_id, deadline, _) in list(children.items()):
        if now >= deadline:
            reap(fd, {"id": request_id, "equal": False, "timeout": True}, kill=True)
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
    """Kill the worker and every child it forked (they share its process group), then reap it."""
    if hasattr(os, "killpg"):
        with contextlib.suppress(OSError):  # ProcessLookupError: the group is gone already
            os.killpg(proc.pid, signal.SIGKILL)  # pgid == pid: the worker leads its own session
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    with contextlib.suppress(OSError):
        proc.stdin.close()  # stdout belongs to the reader thread, which closes it at end of stream


class _Reply:
    """Where the reader thread leaves the reply to one request."""

    __slots__ = ("done", "reply")

    def __init__(self):
        self.done = threading.Event()
        self.reply: dict | None = None  # None once done: the worker died before answering


class _Worker:
    """One worker process, as the parent sees it: its pipe, the requests in flight, a reader thread."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.owner_pid = os.getpid()
        self.alive, self.ready, self.parallel = True, False, 1
        self.hello: queue.Queue = queue.Queue()
        self.pending: dict[int, _Reply] = {}
        self.lock = threading.Lock()  # guards alive and pending, shared with the reader thread
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True, name="math-verify-reader").start()

    def submit(self, request: dict) -> _Reply:
        """Send one request; the returned slot is filled by the reader (at once if the worker is gone)."""
        slot = _Reply()
        with self.lock:
            if self.alive:
                self.pending[request["id"]] = slot
                try:
                    self.proc.stdin.write(json.dumps(request) + "\n")
                    self.proc.stdin.flush()
                    return slot
                except OSError:  # BrokenPipeError: the worker is gone
                    del self.pending[request["id"]]
        slot.done.set()
        return slot

    def deliver(self, reply: dict) -> None:
        """Hand one reply line to the request waiting for its id; a line nobody waits for is dropped."""
        with self.lock:
            slot = self.pending.pop(reply.get("id"), None)
        if slot is not None:
            slot.reply = reply
            slot.done.set()

    def _read(self, stream) -> None:
        try:
            for line in iter(stream.readline, ""):
                message = json.loads(line)
                if "ready" in message:
                    self.hello.put(message)
                else:
                    self.deliver(message)
        except (OSError, ValueError):  # stream closed under us, or a garbled line: treat as a crash
            pass
        finally:
            with self.lock:  # end of stream: the worker exited or was killed
                self.alive = False
                orphans, self.pending = list(self.pending.values()), {}
            for slot in orphans:
                slot.done.set()
            self.hello.put(None)
            stream.close()


class MathVerifier:
    """math-verify equivalence under a hard wall-clock limit, many answers at once, from any thread.

    `equivalent_many` checks a batch side by side (up to `max_parallel` children; see the module
    docstring), so slow answers cost one limit together rather than one each; `equivalent` is a
    batch of one. Starting the worker is awaited up to `startup_timeout_s` and is not counted in
    the limit; neither is a restart after the worker died or stopped answering (it happens in the
    background). Counters: `calls`, `timeouts`, `crashes` (a child or the worker died without
    answering), `worker_errors` (math-verify raised; scored not equal).
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, *, startup_timeout_s: float = 120.0,
                 memory_limit_mb: int = 2048, max_parallel: int = DEFAULT_MAX_PARALLEL):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0 seconds, got {startup_timeout_s}")
        if memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb must be >= 0 (0 = no cap), got {memory_limit_mb}")
        if not (isinstance(max_parallel, int) and max_parallel >= 1):
            raise ValueError(f"max_parallel must be an integer >= 1, got {max_parallel!r}")
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.memory_limit_mb = int(memory_limit_mb)
        self.max_parallel = max_parallel
        self.calls = self.timeouts = self.crashes = self.worker_errors = 0
        self._lock = threading.Lock()  # guards the worker slot, the id counter and the counters
        self._worker: _Worker | None = None
        self._finalizer: weakref.finalize | None = None
        self._next_id = 0

    def __getstate__(self) -> dict:  # a pickled copy (e.g. in another process) starts its own worker
        return {"timeout_s": self.timeout_s, "startup_timeout_s": self.startup_timeout_s,
                "memory_limit_mb": self.memory_limit_mb, "max_parallel": self.max_parallel}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def _proc(self) -> subprocess.Popen | None:
        """The current worker process (None before the first start)."""
        return None if self._worker is None else self._worker.proc

    def start(self) -> None:
        """Start the worker and wait until math-verify is imported (optional: the first call does it)."""
        with self._lock:
            self._ready_worker()

    def close(self) -> None:
        """Stop the worker and its children; a later call starts a new one."""
        with self._lock:
            self._discard_worker()

    def equivalent(self, gold: str, pred: str, *, timeout_s: float | None = None) -> bool:
        """math-verify's ``verify(parse(gold), parse(pred))`` on both wrapped as ``$...$``; False on
        timeout, on a crash, or when either side does not parse."""
        return self.equivalent_many([(gold, pred)], timeout_s=timeout_s)[0]

    def equivalent_many(self, pairs, *, timeout_s: float | None = None) -> list[bool]:
        """`equivalent` for each ``(gold, pred)`` pair, compared side by side: each pair has its own
        limit (`timeout_s`, default the verifier's), counted from when its comparison starts."""
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        if not limit > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        pairs = [(str(gold), str(pred)) for gold, pred in pairs]
        for gold, pred in pairs:
            if len(gold) + len(pred) > _MAX_REQUEST_CHARS:
                raise ValueError(f"answers too long for the verifier ({len(gold) + len(pred)} characters, "
                                 f"max {_MAX_REQUEST_CHARS}): cap the answer length before calling")
        if not pairs:
            return []
        with self._lock:
            worker = self._ready_worker()
            slots = []
            for gold, pred in pairs:
                self._next_id += 1
                slots.append(worker.submit({"id": self._next_id, "gold": _latex_for_parse(gold),
                                            "pred": _latex_for_parse(pred), "limit": limit}))
            self.calls += len(pairs)
            in_flight = len(worker.pending)
        guard = time.monotonic() + limit * math.ceil(max(in_flight, 1) / worker.parallel) + _GUARD_GRACE_S
        for slot in slots:
            slot.done.wait(max(0.0, guard - time.monotonic()))
        results = []
        with self._lock:
            for slot in slots:
                reply = slot.reply
                if not slot.done.is_set() or (reply is not None and reply.get("timeout")):
                    self.timeouts += 1
                elif reply is None or reply.get("crash"):
                    self.crashes += 1
                else:
                    self.worker_errors += "error" in reply
                results.append(bool(reply and reply.get("equal")))
            stuck = not all(slot.done.is_set() for slot in slots)
            if (stuck or not worker.alive) and self._worker is worker:
                self._restart()  # kill it (and its children) and start a fresh worker now
        return results

    # -- worker lifecycle (callers hold self._lock) --------------------------------------------------

    def _spawn(self) -> None:
        cpu_budget_s = max(10, int(10 * self.timeout_s))  # orphan guard only; the worker kills far sooner
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_SOURCE, str(self.memory_limit_mb), str(cpu_budget_s),
             str(self.max_parallel)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8",
            start_new_session=True)  # own process group (killed as one); a terminal Ctrl-C spares it
        self._worker = _Worker(proc)
        self._finalizer = weakref.finalize(self, _stop_process, proc)

    def _discard_worker(self) -> None:
        worker = self._worker
        if worker is not None and worker.owner_pid == os.getpid() and self._finalizer is not None:
            self._finalizer()  # kills and reaps; a worker inherited through fork belongs to the parent
        self._worker, self._finalizer = None, None

    def _restart(self) -> None:
        # Kill now and start the replacement at once, so its imports overlap with the caller's work.
        self._discard_worker()
        self._spawn()

    def _ready_worker(self) -> _Worker:
        worker = self._worker
        if worker is not None and worker.owner_pid == os.getpid() and not worker.alive:
            self.crashes += 1  # it died between calls (killed from outside, out of memory)
        if worker is None or worker.owner_pid != os.getpid() or not worker.alive:
            self._discard_worker()
            self._spawn()
            worker = self._worker
        if worker.ready:
            return worker
        try:
            hello = worker.hello.get(timeout=self.startup_timeout_s)
        except queue.Empty:
            hello = {"ready": False, "error": f"no answer within {self.startup_timeout_s:.0f} s"}
        if not hello or not hello.get("ready"):
            self._discard_worker()
            why = (hello or {}).get("error", "worker exited")
            raise RuntimeError(f"math-verify worker failed to start ({why}): check that math-verify is "
                               f"installed for {sys.executable}")
        worker.ready, worker.parallel = True, int(hello.get("parallel", 1))
        return worker


_shared: MathVerifier | None = None
_shared_lock = threading.Lock()


def shared_verifier() -> MathVerifier:
    """The process-wide verifier used when none is passed (started on first use, default limit)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MathVerifier()
        return _shared
