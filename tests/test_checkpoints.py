"""Checkpoints that are checked on load, and training checkpoints that survive `kill -9`.

1. Loading an NVFP4 checkpoint validates it (qerl_lib.models.loader): every tensor kind of a tiny
   NVFP4 checkpoint (packed codes, block scales, global scale, a norm, the embedding) is corrupted
   with NaN, zero, a negative value, a truncated file and a wrong shape. Each value the format does
   not allow fails with one line naming the tensor and the file; each it allows still loads.
2. Quantizing refuses a NaN weight on both backends, and exporting an adapter that merges to NaN,
   before anything is written.
3. Training checkpoints count only once their marker is written last (qerl_lib.train.metrics): the
   helpers on hand-made folders, then fault injection on the tiny Llama of tests/test_grpo.py: a run
   is SIGKILLed at random moments and inside each phase of a checkpoint write (TRL's files, the
   fsync, the marker, the rotation of old checkpoints, the final adapter), its newest checkpoint is
   sometimes damaged afterwards, and it is resumed each time (through the sweep's
   `_train_resumably`, which resumes with `qerl train --resume` semantics). The final adapter must
   be byte-identical to an uninterrupted run's, and every metrics line equal to it except timings.

Runs are forked from a preloaded server process (multiprocessing "forkserver"), so a kill point
costs about a second, not an interpreter start (~8 s with torch, transformers and TRL).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import shutil
import signal
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qerl_lib.cli import main
from qerl_lib.errors import UserError
from qerl_lib.models.loader import load_model, quantize_checkpoint
from qerl_lib.train.metrics import (SIDE_STATE, checkpoint_problem, last_complete_checkpoint, mark_checkpoint_complete,
                                    prepare_output, rotate_checkpoints)
from test_grpo import tiny_config, toy_reward  # shared tiny-model helpers
from test_safe_outputs import tree_hash

TIMING = {"rollout_seconds", "rollout_tokens_per_s", "train_seconds", "step_seconds", "step_time", "peak_memory_gb",
          "memory_kind"}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):  # conftest.py
    yield


@pytest.fixture(scope="module")
def nvfp4_dir(tiny_dir, tmp_path_factory):
    return quantize_checkpoint(tiny_dir, tmp_path_factory.mktemp("q") / "nvfp4", backend="native")


# ============================================================================ 1. validation on load
LAYER = "model.layers.1.mlp.up_proj"
KINDS = {"packed": f"{LAYER}.weight_packed", "block_scale": f"{LAYER}.weight_scale",
         "global_scale": f"{LAYER}.weight_global_scale", "norm": "model.layers.0.input_layernorm.weight",
         "embedding": "model.embed_tokens.weight"}
# value corruptions the format allows (the checkpoint must still load); uint8 codes cannot hold NaN or < 0
ALLOWED = {("packed", "zero"), ("block_scale", "zero"), ("norm", "zero"), ("norm", "negative"),
           ("embedding", "zero"), ("embedding", "negative")}
NOT_REPRESENTABLE = {("packed", "nan"), ("packed", "negative")}
VALUES = {"nan": float("nan"), "zero": 0.0, "negative": -1.0}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _set_one(tensor: torch.Tensor, value: float) -> torch.Tensor:
    t = tensor.clone()
    if t.dtype == torch.uint8:
        t.view(-1)[3] = int(value)
    elif t.dtype == torch.float8_e4m3fn:
        t.view(-1)[3:4] = torch.tensor([value]).to(torch.float8_e4m3fn)
    else:
        t.view(-1)[t.numel() // 2] = value
    return t


def _reshaped(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() == 1:
        return torch.cat([tensor, tensor[:1]])
    return tensor[:, :-1].contiguous()


def _truncate_inside(path: Path, key: str) -> None:
    """Cut the file one byte into ``key``'s data (every tensor stored after it is cut off too)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    start = json.loads(raw[8:8 + length])[key]["data_offsets"][0]
    path.write_bytes(raw[:8 + length + start + 1])


def corrupt(src: Path, dst: Path, kind: str, how: str) -> Path:
    shutil.copytree(src, dst)
    file = dst / "model.safetensors"
    key = KINDS[kind]
    if how == "truncated":
        _truncate_inside(file, key)
        return dst
    tensors = _tensors(file)
    tensors[key] = _reshaped(tensors[key]) if how == "wrong_shape" else _set_one(tensors[key], VALUES[how])
    save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


CASES = [(k, h) for k in KINDS for h in ("nan", "zero", "negative", "truncated", "wrong_shape")
         if (k, h) not in NOT_REPRESENTABLE]


@pytest.mark.parametrize("kind,how", CASES, ids=[f"{k}-{h}" for k, h in CASES])
def test_corrupt_tensor_fails_in_one_line_naming_it(kind, how, nvfp4_dir, tmp_path):
    bad = corrupt(nvfp4_dir, tmp_path / "bad", kind, how)
    if (kind, how) in ALLOWED:
        loaded = load_model(bad).state_dict()[KINDS[kind]]  # a legal value: loads, and holds it
        stored = _tensors(bad / "model.safetensors")[KINDS[kind]]  # fp32 here: the tiny source is fp32
        assert torch.equal(loaded.view(torch.uint8), stored.to(loaded.dtype).view(torch.uint8))
        return
    with pytest.raises(UserError) as info:
        load_model(bad)
    message = str(info.value)
    assert "\n" not in message and repr(KINDS[kind]) in message and "model.safetensors" in message, message


def test_the_untouched_checkpoint_loads_and_the_cli_reports_in_one_line(nvfp4_dir, tmp_path, capsys):
    load_model(nvfp4_dir)
    bad = corrupt(nvfp4_dir, tmp_path / "bad", "global_scale", "nan")
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and KINDS["global_scale"] in err and "model.safetensors" in err, err


@pytest.mark.parametrize("how,expected", [("inf", "global scale inf"), ("tiny_negative", "global scale -")])
def test_global_scale_must_be_finite_and_positive(how, expected, nvfp4_dir, tmp_path):
    dst = tmp_path / how
    shutil.copytree(nvfp4_dir, dst)
    tensors = _tensors(dst / "model.safetensors")
    tensors[KINDS["global_scale"]] = torch.tensor([float("inf") if how == "inf" else -1e-30])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=expected):
        load_model(dst)


def test_truncated_dense_checkpoint_names_the_tensor(tiny_dir, tmp_path):
    dst = tmp_path / "dense"
    shutil.copytree(tiny_dir, dst)
    _truncate_inside(dst / "model.safetensors", "model.norm.weight")
    with pytest.raises(UserError, match=r"model\.safetensors: truncated file: tensor 'model\.norm\.weight'"):
        load_model(dst)


# ============================================================================ 2. quantizing refuses NaN
@pytest.mark.parametrize("backend", ["native", "llmcompressor"])
@pytest.mark.parametrize("key", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"])
def test_quantize_refuses_a_nan_weight_before_writing(backend, key, tiny_dir, tmp_path):
    src = tmp_path / "nan-model"
    shutil.copytree(tiny_dir, src)
    tensors = _tensors(src / "model.safetensors")
    tensors[key] = _set_one(tensors[key], float("nan"))
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    before = tree_hash(tmp_path)
    with pytest.raises(UserError) as info:
        quantize_checkpoint(src, tmp_path / "out", backend=backend)
    message = str(info.value)
    assert "\n" not in message and repr(key) in message and "model.safetensors" in message, message
    assert tree_hash(tmp_path) == before, "something was written (or changed) before the refusal"


@pytest.mark.parametrize("requantize", [False, True], ids=["bf16", "requantize"])
def test_export_refuses_an_adapter_that_merges_to_nan(requantize, tiny_dir, tmp_path):
    from qerl_lib.models.lora import attach_lora, export_model, save_adapters

    peft_model = attach_lora(load_model(tiny_dir), rank=4)
    with torch.no_grad():
        lora_b = next(p for n, p in peft_model.named_parameters() if "layers.0.self_attn.q_proj.lora_B" in n)
        lora_b[0, 0] = float("nan")
    adapter = save_adapters(peft_model, tmp_path / "adapter")
    before = tree_hash(tmp_path)
    with pytest.raises(UserError, match=r"adapter: merging this adapter gives NaN or Inf in "
                                        r"'model\.layers\.0\.self_attn\.q_proj\.weight'"):
        export_model(tiny_dir, adapter, tmp_path / "out", requantize=requantize)
    assert tree_hash(tmp_path) == before


# ============================================================================ 3. crash-proof checkpoints
def _fake_checkpoint(folder: Path, step: int, complete: bool = True) -> Path:
    ckpt = folder / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_model.safetensors").write_bytes(bytes(100 + step))
    (ckpt / "optimizer.pt").write_bytes(bytes(50))
    if complete:
        mark_checkpoint_complete(ckpt, {"step": step, "aqn": None})
    return ckpt


def test_only_marked_checkpoints_with_their_files_count(tmp_path):
    folder = tmp_path / "checkpoints"
    assert last_complete_checkpoint(folder) is None  # no folder at all
    two, four = _fake_checkpoint(folder, 2), _fake_checkpoint(folder, 4)
    six = _fake_checkpoint(folder, 6, complete=False)  # killed while saving
    assert "no qerl_state.json" in checkpoint_problem(six)
    marker = json.loads((four / SIDE_STATE).read_text())
    assert marker["files"] == {"adapter_model.safetensors": 104, "optimizer.pt": 50} and marker["step"] == 4
    lines: list[str] = []
    assert last_complete_checkpoint(folder, lines.append) == four
    assert lines == ["skipping checkpoint-6: incomplete (no qerl_state.json (the run stopped while writing it))",
                     "resuming from checkpoint-4, the newest complete checkpoint"]
    (four / "optimizer.pt").write_bytes(bytes(10))  # damaged after the marker: sizes disagree
    assert "optimizer.pt has 10 bytes, 50" in checkpoint_problem(four)
    (two / "optimizer.pt").unlink()
    assert checkpoint_problem(two) == "optimizer.pt is missing"
    assert last_complete_checkpoint(folder) is None
    (two / SIDE_STATE).write_text('{"step": 2')  # torn (cannot happen through the atomic write)
    assert checkpoint_problem(two) == f"unreadable {SIDE_STATE}"
    (folder / "checkpoint-9.tmp").mkdir()  # not a checkpoint name
    (folder / "checkpoint-8").write_text("a file")
    assert last_complete_checkpoint(folder) is None


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _fake_checkpoint(folder, step)
    _fake_checkpoint(folder, 4, complete=False)
    old_incomplete = _fake_checkpoint(folder, 0, complete=False)
    removed = rotate_checkpoints(folder, keep=1)
    assert sorted(p.name for p in removed) == ["checkpoint-0", "checkpoint-1", "checkpoint-2"]
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert not old_incomplete.exists()
    assert rotate_checkpoints(folder, keep=1) == []


def test_resume_skips_incomplete_checkpoints_and_restarts_without_any(tiny_dir, tmp_path):
    config = tiny_config(tiny_dir, "lora", steps=4)
    out = tmp_path / "run"
    assert prepare_output(out, config, resume=False) is None
    rows = [{"step": s, "reward": float(s)} for s in (1, 2, 3, 4)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = out / "checkpoints"
    two = _fake_checkpoint(folder, 2)
    _fake_checkpoint(folder, 3, complete=False)
    lines: list[str] = []
    assert prepare_output(out, config, resume=True, report=lines.append) == two
    assert not (folder / "checkpoint-3").exists(), "the incomplete checkpoint would be written into again"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert lines[-1] == "resuming from checkpoint-2, the newest complete checkpoint"
    (two / SIDE_STATE).unlink()
    assert prepare_output(out, config, resume=True, report=lines.append) is None
    assert lines[-1].startswith("no complete checkpoint") and not list(folder.iterdir())
    assert (out / "metrics.jsonl").read_text() == ""


# ---------------------------------------------------------------------------- fault injection
STEPS = 4
PHASES = ("optimizer", "rng", "fsync", "marker", "rotate", "metrics", "adapter")


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(phase: str, occurrence: int) -> None:
    """Make this (forked) process SIGKILL itself at the ``occurrence``-th time it reaches ``phase``."""
    from transformers import Trainer

    import qerl_lib.models.lora as lora
    import qerl_lib.train.metrics as metrics

    calls = {"n": 0}

    def due() -> bool:
        calls["n"] += 1
        return calls["n"] == occurrence

    if phase in ("optimizer", "rng"):  # TRL has written the adapter (and the optimizer), not the rest
        name = "_save_optimizer_and_scheduler" if phase == "optimizer" else "_save_rng_state"
        original = getattr(Trainer, name)

        def hooked(self, *args, **kwargs):
            if due():
                _die()
            return original(self, *args, **kwargs)
        setattr(Trainer, name, hooked)
    elif phase == "fsync":  # every file on disk, no marker yet
        original_fsync = metrics.fsync_tree

        def fsync_then_die(folder):
            sizes = original_fsync(folder)
            if due():
                _die()
            return sizes
        metrics.fsync_tree = fsync_then_die
    elif phase == "marker":  # the marker's temp file half-written, not renamed
        original_write = metrics.write_json_atomic

        def torn_marker(path, obj, *args, **kwargs):
            if Path(path).name == SIDE_STATE and due():
                (Path(path).parent / f".{SIDE_STATE}.torn.tmp").write_text(json.dumps(obj)[:20])
                _die()
            return original_write(path, obj, *args, **kwargs)
        metrics.write_json_atomic = torn_marker
    elif phase == "rotate":  # the new checkpoint is marked; an old one is half deleted
        original_rotate = metrics.rotate_checkpoints

        def half_rotate(folder, keep):
            old = metrics.checkpoints_by_step(folder)[:-1]
            if old and due():
                next(p for p in sorted(old[0][1].iterdir()) if p.name != SIDE_STATE).unlink()
                _die()
            return original_rotate(folder, keep)
        metrics.rotate_checkpoints = half_rotate
    elif phase == "metrics":  # after an optimizer step, before its line is logged
        original_append = metrics.append_jsonl_atomic

        def append_then_die(path, row):
            if due():
                _die()
            return original_append(path, row)
        metrics.append_jsonl_atomic = append_then_die
    elif phase == "adapter":  # the final adapter written into its temp folder, not yet renamed
        original_dir = lora.atomic_directory

        @contextlib.contextmanager
        def die_before_rename(final):
            with original_dir(final) as tmp:
                yield tmp
                if due():
                    _die()
        lora.atomic_directory = die_before_rename


def _worker(model_dir: str, out: str, seed: int, plan: tuple[str, int] | None, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    if plan is not None:
        _arm(*plan)
    from qerl_lib.studies.sweep import _train_resumably

    # save every step, keep one checkpoint: the rotation deletes the only other complete one each save
    config = dataclasses.replace(tiny_config(model_dir, "qerl", steps=STEPS, save_total_limit=1), seed=seed)
    _train_resumably(config, Path(out))


def _noop() -> None:
    pass


@pytest.fixture(scope="module")
def forkserver():
    """A forkserver that has imported torch, transformers, TRL and this module (Python 3.11 does not hand it
    sys.path, so PYTHONPATH carries the tests folder), started and warmed before any run is timed."""
    import multiprocessing.forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "trl", "peft", "qerl_lib.train.grpo",
                                "qerl_lib.train.trainer", "qerl_lib.studies.sweep", "test_grpo", "test_checkpoints"])
    here = Path(__file__).resolve().parent
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), *([saved] if saved else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    warm = ctx.Process(target=_noop)
    warm.start()
    warm.join(timeout=120)
    assert warm.exitcode == 0
    return ctx


def _launch(ctx, model_dir: Path, out: Path, seed: int, plan=None, kill_after: float | None = None) -> int:
    """One training process; SIGKILLed by this test after ``kill_after`` s if still alive. Its exit code."""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = ctx.Process(target=_worker, args=(str(model_dir), str(out), seed, plan, str(out.parent / "log.txt")))
    proc.start()
    proc.join(timeout=kill_after if kill_after is not None else 120)
    if proc.is_alive():
        if kill_after is None:
            proc.kill()
            pytest.fail(f"a training process hung; see {out.parent / 'log.txt'}")
        proc.kill()
        proc.join()
    return proc.exitcode


def _damage_newest_checkpoint(out: Path, rng: random.Random) -> str | None:
    """After a kill, sometimes damage the newest checkpoint as a crash mid-write (or a bad disk) would."""
    found = sorted((out / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if not found or rng.random() < 0.5:
        return None
    newest = found[-1]
    files = sorted(p for p in newest.iterdir() if p.is_file() and p.name != SIDE_STATE)
    if not files:
        return None  # killed just after the folder was made
    victim = rng.choice(files)
    if rng.random() < 0.5:  # as if killed before these were written: no marker, a file missing
        (newest / SIDE_STATE).unlink(missing_ok=True)
        victim.unlink()
        return f"{newest.name}: removed marker and {victim.name}"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # marker kept, file cut short
    return f"{newest.name}: truncated {victim.name}"


def _newest_complete_step(out: Path) -> int:
    newest = last_complete_checkpoint(out / "checkpoints")
    return int(newest.name.split("-")[1]) if newest is not None else 0


def _assert_progress_kept(out: Path, floor: int, damaged: bool, events: list[str]) -> int:
    """What a kill may cost: never a checkpoint that was complete before it (the newest complete step never
    goes back), and, with a save every step, only the step being saved: the newest complete checkpoint is at
    most one step behind the last logged step (lines are logged just before the step's save). The second
    holds until this test damages a checkpoint itself. Returns the newest complete step."""
    saved = _newest_complete_step(out)
    assert saved >= floor, f"a kill destroyed complete checkpoint-{floor}:\n" + "\n".join(events)
    metrics = out / "metrics.jsonl"
    logged = max((json.loads(x)["step"] for x in metrics.read_text().splitlines()), default=0) \
        if metrics.is_file() else 0
    assert damaged or saved >= logged - 1, (f"killed with steps up to {logged} logged but the newest complete "
                                            f"checkpoint at step {saved}:\n" + "\n".join(events))
    return saved


def _events(rng: random.Random):
    """Every checkpoint-write phase once, in a random order and at a random save, then random moments."""
    phases = [("phase", (phase, 1 if phase in ("rotate", "adapter") else rng.randint(1, 2 if phase != "metrics"
                                                                                     else STEPS)))
              for phase in PHASES]
    rng.shuffle(phases)
    yield from phases
    while True:
        yield ("time", None)


def _run_with_kills(ctx, model_dir: Path, root: Path, seed: int, rng: random.Random, n_kills: int,
                    uninterrupted_seconds: float, reference: Path) -> int:
    """Kill, damage and resume runs until ``n_kills`` processes were SIGKILLed. A run that finishes (a kill
    that came too late) is compared with the reference, and the next kills hit a new run; the last run
    is finished without a kill and compared too. Returns the number of runs compared."""
    life, out, kills, events, floor, damaged = 0, root / "run-0", 0, [], 0, False
    for kind, plan in _events(rng):
        if kills >= n_kills:
            break
        delay = None if kind == "phase" else rng.uniform(0.05, uninterrupted_seconds)
        start = time.monotonic()
        code = _launch(ctx, model_dir, out, seed, plan=plan, kill_after=delay)
        events.append(f"{out.name}: {kind} {plan or round(delay, 2)} -> exit {code} "
                      f"after {time.monotonic() - start:.1f} s")
        if code == -signal.SIGKILL:
            kills += 1
            floor = _assert_progress_kept(out, floor, damaged, events)
            # phases first, undamaged; and none once the final adapter exists: the kill came after training ended
            # (the process was exiting), a resume returns at once, and a checkpoint damaged then is never read
            finished = (out / "adapter" / "adapter_config.json").is_file()
            damage = _damage_newest_checkpoint(out, rng) if kind == "time" and not finished else None
            if damage:
                events.append(f"  damaged {damage}")
                damaged, floor = True, _newest_complete_step(out)
        elif code == 0:
            _assert_same_run(reference, out, events)
            life, floor, damaged = life + 1, 0, False
            out = root / f"run-{life}"
        else:
            pytest.fail(f"exit {code}:\n" + "\n".join(events) + "\n" + (root / "log.txt").read_text()[-3000:])
    assert _launch(ctx, model_dir, out, seed) == 0, (root / "log.txt").read_text()[-3000:]
    _assert_same_run(reference, out, events)
    return life + 1


def _reference(ctx, model_dir: Path, root: Path, seed: int) -> tuple[Path, float]:
    start = time.monotonic()
    assert _launch(ctx, model_dir, root / "run", seed) == 0, (root / "log.txt").read_text()[-3000:]
    return root / "run", time.monotonic() - start


def _assert_same_run(reference: Path, resumed: Path, events: list[str]) -> None:
    a = (reference / "adapter" / "adapter_model.safetensors").read_bytes()
    b = (resumed / "adapter" / "adapter_model.safetensors").read_bytes()
    assert a == b, "the killed-and-resumed run ended with other adapter bytes:\n" + "\n".join(events)
    rows_a = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == list(range(1, STEPS + 1)), "\n".join(events)
    for ra, rb in zip(rows_a, rows_b):
        differ = {k: (ra[k], rb.get(k)) for k in ra if k not in TIMING and ra[k] != rb.get(k)}
        assert not differ, f"step {ra['step']} differs: {differ}\n" + "\n".join(events)
    assert last_complete_checkpoint(resumed / "checkpoints").name == f"checkpoint-{STEPS}"


def _fault_injection(forkserver, tiny_dir, tmp_path, seeds: list[int], kill_seeds: list[int], n_kills: int) -> None:
    for seed in seeds:
        reference, seconds = _reference(forkserver, tiny_dir, tmp_path / f"ref-{seed}", seed)
        for kill_seed in kill_seeds:
            _run_with_kills(forkserver, tiny_dir, tmp_path / f"s{seed}-k{kill_seed}", seed, random.Random(kill_seed),
                            n_kills, seconds, reference)


def test_runs_killed_at_random_and_while_checkpointing_resume_to_the_same_adapter(forkserver, tiny_dir, tmp_path):
    """One training seed, two kill schedules of 10 kills each (every checkpoint-write phase, then random
    moments): 20 kill points, ~30 s on 2 cores."""
    _fault_injection(forkserver, tiny_dir, tmp_path, seeds=[0], kill_seeds=[1, 2], n_kills=10)


@pytest.mark.slow
def test_many_kill_points_over_several_seeds(forkserver, tiny_dir, tmp_path):
    """Two training seeds x three kill schedules of 20 kills each (120 kill points); ~2.5 min on 2 cores."""
    _fault_injection(forkserver, tiny_dir, tmp_path, seeds=[0, 1], kill_seeds=[3, 4, 5], n_kills=20)


def test_on_save_waits_for_every_process_and_drops_the_pickled_training_args(tmp_path, monkeypatch):
    """Each process calls on_save after writing its own files (rng_state_K.pth): all meet at a barrier before
    process 0 lists the files' sizes in the marker; transformers' pickled training_args.bin is removed first."""
    from types import SimpleNamespace

    import qerl_lib.train.metrics as metrics

    folder = _fake_checkpoint(tmp_path / "checkpoints", 3, complete=False)
    (folder / metrics.PICKLED_ARGS).write_bytes(b"\x80\x04pickle")
    order: list[str] = []
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: order.append("barrier"))
    original = metrics.mark_checkpoint_complete
    monkeypatch.setattr(metrics, "mark_checkpoint_complete", lambda f, side: order.append("marker") or original(f, side))
    callback = metrics.RunMetrics(tmp_path, config=None, reward_funcs=[], rollout=SimpleNamespace(aqn=None), quiet=True)
    args = SimpleNamespace(output_dir=str(tmp_path / "checkpoints"))
    callback.on_save(args, SimpleNamespace(is_world_process_zero=False, global_step=3), None)
    assert order == ["barrier"] and (folder / metrics.PICKLED_ARGS).exists() and checkpoint_problem(folder)
    callback.on_save(args, SimpleNamespace(is_world_process_zero=True, global_step=3), None)
    assert order == ["barrier", "barrier", "marker"]
    assert not (folder / metrics.PICKLED_ARGS).exists() and checkpoint_problem(folder) is None
    assert set(json.loads((folder / SIDE_STATE).read_text())["files"]) == {"adapter_model.safetensors", "optimizer.pt"}
