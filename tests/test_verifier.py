"""Tests for qerl_lib.tasks.verifier: math-verify in killable children of a warm worker, under a hard
wall-clock limit.

Equivalence itself (what counts as equal) is math-verify's; these tests pin the machinery around
it: the limit holds on inputs that hang math-verify, a batch of them ends after about one limit,
the worker recovers, threads are fine, stale replies are never taken for another answer, close()
leaves no process behind, and the orphan guards (memory, CPU) are set.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from qerl_lib.tasks.verifier import DEFAULT_TIMEOUT_S, MathVerifier, shared_verifier

# The tests assert on the verifier's counters (a kill-on-timeout per hanging comparison, crashes). Wall-clock time
# is only a hang guard: math-verify computes HANGING for minutes, so "limit + 10 s" still catches a limit that does
# not hold, without failing on a loaded runner.
HANG_GUARD_S = 10.0
# The parallelism tests give each hanging comparison a 3 s limit: six of them one after another take >= 18 s, side
# by side about 3 s; the bound, two limits, leaves 3 s of slack and is still far from the serial time.
PARALLEL_LIMIT_S = 3.0
# math-verify 0.9 is still computing this tower after 10 s (a C-level big-integer power).
HANGING = "10^{10^{10^{10}}}"




@pytest.mark.parametrize("gold, pred, expected", [
    ("72", "72", True), ("0.5", "\\frac{1}{2}", True), ("8", "2^{3}", True), ("2", "\\sqrt{4}", True),
    ("72", "75", False), ("18", "18 or 19", False), ("x", "", False),
], ids=["same", "frac-decimal", "power", "sqrt", "different", "hedged", "empty-pred"])
def test_equivalent(verifier, gold, pred, expected):
    assert verifier.equivalent(gold, pred) is expected


def test_default_limit_holds_and_worker_recovers(verifier):
    verifier.start()
    timeouts_before = verifier.timeouts
    start = time.monotonic()
    assert verifier.equivalent("18", HANGING) is False
    elapsed = time.monotonic() - start
    assert elapsed < DEFAULT_TIMEOUT_S + HANG_GUARD_S, f"took {elapsed:.2f} s: the limit did not hold"
    # The limit (not a quick refusal) must have ended it: one kill-on-timeout was counted.
    assert verifier.timeouts == timeouts_before + 1, "expected a kill-on-timeout; did math-verify change?"
    assert verifier.equivalent("0.5", "\\frac{1}{2}") is True  # the restarted worker works


def test_per_call_limit_overrides_the_default():
    # a 60 s default and a 0.5 s limit for the call: the call must end by a kill well before the default would
    v = MathVerifier(timeout_s=60.0)
    try:
        v.start()
        start = time.monotonic()
        assert v.equivalent("18", HANGING, timeout_s=0.5) is False
        elapsed = time.monotonic() - start
        assert v.timeouts == 1 and v.crashes == 0, "the per-call limit must have stopped it"
        assert elapsed < 0.5 + HANG_GUARD_S, f"took {elapsed:.2f} s: the 60 s default applied, not the call's 0.5 s"
    finally:
        v.close()


def test_limit_holds_from_a_non_main_thread(quick_verifier):
    # math-verify's own signal-based timeout raises outside the main thread; ours must not care.
    quick_verifier.start()
    timeouts = quick_verifier.timeouts
    result = {}

    def score():
        start = time.monotonic()
        result["hanging"] = quick_verifier.equivalent("18", HANGING)
        result["elapsed"] = time.monotonic() - start
        result["correct"] = quick_verifier.equivalent("18", "\\sqrt{324}")

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=60)
    assert result["hanging"] is False and result["correct"] is True
    assert quick_verifier.timeouts == timeouts + 1, "the limit (a kill-on-timeout) must have ended the comparison"
    assert result["elapsed"] < quick_verifier.timeout_s + HANG_GUARD_S, f"took {result['elapsed']:.2f} s"


def test_stale_reply_is_never_taken_for_the_current_request(quick_verifier):
    # A reply carrying an id nobody waits for (e.g. from a request that timed out) must be dropped.
    quick_verifier.start()
    quick_verifier._worker.deliver({"id": -5, "equal": True})
    quick_verifier._worker.deliver({"id": quick_verifier._next_id + 1, "equal": True})  # the next id, early
    assert quick_verifier.equivalent("72", "75") is False


def test_worker_killed_between_calls_is_replaced(quick_verifier):
    quick_verifier.start()
    quick_verifier._proc.kill()
    quick_verifier._proc.wait(timeout=10)
    time.sleep(0.2)  # let the reader thread see the end of the stream
    crashes = quick_verifier.crashes
    assert quick_verifier.equivalent("1", "1") is True  # a fresh worker answers ...
    assert quick_verifier.crashes == crashes + 1  # ... and the death is counted


def test_worker_killed_mid_request_fails_fast_and_recovers(verifier):
    verifier.start()
    crashes, proc = verifier.crashes, verifier._proc
    timeouts = verifier.timeouts
    threading.Timer(0.3, proc.kill).start()
    start = time.monotonic()
    assert verifier.equivalent("18", HANGING, timeout_s=30) is False
    elapsed = time.monotonic() - start
    assert verifier.crashes == crashes + 1 and verifier.timeouts == timeouts, "the death, not the limit, ended it"
    assert elapsed < 15, f"took {elapsed:.2f} s: a dead worker must not be waited on until the 30 s limit"
    assert verifier.equivalent("0.5", "\\frac{1}{2}") is True


def test_batch_of_hanging_answers_times_out_in_parallel(quick_verifier):
    # Six comparisons that each hang math-verify: one limit in all, not six, and each one killed.
    quick_verifier.start()
    timeouts, crashes = quick_verifier.timeouts, quick_verifier.crashes
    start = time.monotonic()
    results = quick_verifier.equivalent_many([("18", HANGING)] * 6 + [("2", "\\sqrt{4}")], timeout_s=PARALLEL_LIMIT_S)
    elapsed = time.monotonic() - start
    assert results == [False] * 6 + [True]
    assert quick_verifier.timeouts == timeouts + 6 and quick_verifier.crashes == crashes
    assert elapsed < 2 * PARALLEL_LIMIT_S, f"took {elapsed:.2f} s: not side by side (one after another >= 18 s)"
    assert quick_verifier.equivalent("8", "2^{3}") is True  # the warm worker survived its children's kills


def test_more_answers_than_parallel_children_all_get_answered():
    v = MathVerifier(timeout_s=2.0, max_parallel=2)
    try:
        pairs = [(str(i), f"\\frac{{{2 * i}}}{{2}}") for i in range(7)] + [("1", "2")]
        assert v.equivalent_many(pairs) == [True] * 7 + [False]
        assert v.calls == 8 and v.timeouts == v.crashes == 0
    finally:
        v.close()


def test_threads_share_the_worker(quick_verifier):
    # Four threads, each with one hanging comparison: they overlap too.
    quick_verifier.start()
    timeouts = quick_verifier.timeouts
    results, start = [], time.monotonic()
    threads = [threading.Thread(target=lambda: results.append(
        quick_verifier.equivalent("18", HANGING, timeout_s=PARALLEL_LIMIT_S))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    elapsed = time.monotonic() - start
    assert results == [False] * 4
    assert quick_verifier.timeouts == timeouts + 4, "each thread's comparison must have been stopped by the limit"
    assert elapsed < 2 * PARALLEL_LIMIT_S, f"took {elapsed:.2f} s: the threads did not overlap (in turn >= 12 s)"


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")
def test_close_kills_the_worker_and_its_children():
    v = MathVerifier(timeout_s=30.0)
    v.start()
    group = v._proc.pid
    hung = threading.Thread(target=lambda: v.equivalent("18", HANGING))
    hung.start()
    time.sleep(0.5)  # a child is computing the tower now
    v.close()
    hung.join(timeout=10)
    assert not hung.is_alive(), "a caller waiting on a closed verifier must be released"
    deadline = time.monotonic() + 10  # killed children are reaped by init, which takes a moment
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)  # signal 0: is anything of the worker's process group left?
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"process group {group} still has members 10 s after close()")


def test_verifier_rejects_bad_settings_and_oversized_requests(quick_verifier):
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        MathVerifier(timeout_s=0)
    with pytest.raises(ValueError, match="startup_timeout_s"):
        MathVerifier(startup_timeout_s=-1)
    with pytest.raises(ValueError, match="memory_limit_mb"):
        MathVerifier(memory_limit_mb=-1)
    with pytest.raises(ValueError, match="max_parallel"):
        MathVerifier(max_parallel=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        quick_verifier.equivalent("1", "1", timeout_s=0)
    with pytest.raises(ValueError, match="too long"):
        quick_verifier.equivalent("1", "9" * 30_000)


def test_shared_verifier_is_one_instance():
    assert shared_verifier() is shared_verifier()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/limits (Linux only)")
def test_worker_caps_its_memory_and_cpu():
    # The orphan guards: a worker left computing after its parent died must not run unbounded.
    v = MathVerifier(timeout_s=1.5, memory_limit_mb=1024)
    try:
        v.start()
        assert v.equivalent("8", "2^{3}")  # a request sets the per-request CPU limit
        limits = Path(f"/proc/{v._proc.pid}/limits").read_text()
    finally:
        v.close()
    address_space = next(line for line in limits.splitlines() if line.startswith("Max address space"))
    cpu = next(line for line in limits.splitlines() if line.startswith("Max cpu time"))
    assert address_space.split()[3] == str(1024 * 2**20)
    assert cpu.split()[3] != "unlimited" and int(cpu.split()[3]) <= 15 + 5  # budget max(10, 10 * 1.5) + used
