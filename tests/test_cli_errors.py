"""The CLI's one error path (qerl_lib/cli/__init__.py): every error a user can fix is one line on
stderr naming the file, line or tensor, and exit code 2; ``--debug`` adds the traceback; anything
else still raises with its own.

Commands run in-process through `qerl_lib.cli.main`, as a user sees them. Most cases fail before
any model loads (the data is read first); the adapter cases build two tiny random Llamas (~1 s).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from qerl_lib.cli import main, user_error_message
from qerl_lib.errors import UserError

MISSING_MODEL = "/nonexistent/model"  # a data error must be reported before the model is even looked up


def run(capsys, *argv) -> tuple[int, str]:
    """Exit code and the stderr of `qerl ARGV`."""
    capsys.readouterr()  # drop whatever fixtures printed
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_line(err: str, command: str) -> str:
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith(f"qerl {command}: error: "), lines[0]
    return lines[0]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


GOOD = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}


# ---- data files: found before anything loads ------------------------------------------------------


@pytest.mark.parametrize("answer", ["3 + 4 = 7\n#### ", "#### \n", "####   ,  "], ids=["trailing", "newline", "comma"])
def test_empty_gold_answer_is_found_before_the_model(tmp_path, capsys, answer):
    data = write_jsonl(tmp_path / "test.jsonl", [GOOD, {"question": "q", "answer": answer}])
    code, err = run(capsys, "eval", "--model", MISSING_MODEL, "--data", "file", "--path", data)
    line = one_line(err, "eval")
    assert code == 2 and f"{data}:2" in line and "gold answer is empty" in line


def test_non_utf8_data_file_names_file_and_line(tmp_path, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"question": "caf\xe9?", "answer": "#### 1"}\n'.encode("latin-1"))
    code, err = run(capsys, "eval", "--model", MISSING_MODEL, "--data", "file", "--path", data)
    line = one_line(err, "eval")
    assert code == 2 and f"{data}:2" in line and "not UTF-8" in line and "0xe9" in line


def test_non_utf8_prompts_file_names_file_and_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"first prompt\nsecond \xff prompt\n")
    code, err = run(capsys, "generate", "--model", MISSING_MODEL, "--prompts", prompts)
    line = one_line(err, "generate")
    assert code == 2 and f"{prompts}:2" in line and "0xff" in line


def test_bad_json_line_names_file_and_line(tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n{'question': 'single quotes'}\n")
    code, err = run(capsys, "eval", "--model", MISSING_MODEL, "--data", "file", "--path", data)
    assert code == 2 and f"{data}:3" in one_line(err, "eval")


@pytest.mark.parametrize("argv, match", [
    (["eval", "--model", MISSING_MODEL, "--n", "-3"], "--n must be >= 1"),
    (["eval", "--model", MISSING_MODEL, "--data", "arith", "--n", "0"], "--n must be >= 1"),
    (["data", "arith", "--n", "-1", "--out", "/nonexistent/x.jsonl"], "--n must be >= 1"),
    (["data", "gsm8k", "--path", "/nonexistent/test.jsonl", "--n", "-2", "--out", "/nonexistent/x.jsonl"],
     "--n must be >= 1"),
    (["generate", "--model", MISSING_MODEL, "--prompt", "hi", "--n", "-1"], "--n and --max-new-tokens must be >= 1"),
], ids=["eval", "eval-zero", "data-arith", "data-gsm8k", "generate"])
def test_negative_n_is_an_error_not_a_shorter_list(capsys, argv, match):
    code, err = run(capsys, *argv)
    assert code == 2 and match in one_line(err, argv[0])


def test_data_gsm8k_keeps_every_row_it_is_asked_for(tmp_path, capsys):
    # The positive side of the --n check: --n 2 of 3 rows writes exactly the first 2.
    data = write_jsonl(tmp_path / "in.jsonl", [GOOD, {**GOOD, "question": "b"}, {**GOOD, "question": "c"}])
    code, _ = run(capsys, "data", "gsm8k", "--path", data, "--n", "2", "--out", tmp_path / "out.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert code == 0 and [r["question"] for r in rows] == ["What is 2 + 3?", "b"]


# ---- argparse, --debug, unexpected errors ---------------------------------------------------------


@pytest.mark.parametrize("argv, match", [
    (["eval", "--model", "m", "--n", "x"], "invalid int value: 'x'"),
    (["eval"], "--model"),
    (["eval", "--model", "m", "--data", "nope"], "invalid choice"),
], ids=["bad-int", "missing-required", "bad-choice"])
def test_argparse_errors_are_one_line(capsys, argv, match):
    code, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("qerl eval: error:") and match in lines[0], err


@pytest.mark.parametrize("where", ["after", "before"])
def test_debug_adds_the_traceback(capsys, where):
    argv = ["eval", "--model", MISSING_MODEL, "--n", "-3"]
    argv = argv + ["--debug"] if where == "after" else ["--debug"] + argv
    code, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback (most recent call last)" in err and "UserError" in err
    assert lines[-1].startswith("qerl eval: error: --n must be >= 1")
    code, err = run(capsys, "eval", "--model", MISSING_MODEL, "--n", "-3")
    assert "Traceback" not in err  # and without it, none


def test_unexpected_errors_keep_their_traceback(monkeypatch, capsys):
    from qerl_lib.tasks import problems

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug, not a user error")

    monkeypatch.setattr(problems, "load_problems", broken)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        main(["eval", "--model", MISSING_MODEL, "--data", "arith", "--n", "1"])
    assert "error:" not in capsys.readouterr().err


# ---- library exceptions -> one line naming the file ------------------------------------------------


def _raised(func, *args):
    try:
        func(*args)
    except Exception as exc:  # noqa: BLE001 -- the exception is what the test looks at
        return exc
    raise AssertionError(f"{func.__name__} did not raise")


def test_json_error_names_file_line_and_column(tmp_path):
    def read_config(path):  # a reader that, like many, does not catch the error itself
        return json.loads(Path(path).read_text())

    path = tmp_path / "config.json"
    path.write_text('{\n  "hidden_size": 64,\n  oops\n}\n')
    message = user_error_message(_raised(read_config, path))
    assert message.startswith(f"{path}:3:3: not valid JSON") and "double quotes" in message


def test_json_error_in_a_jsonl_line_names_that_line(tmp_path):
    def read_rows(folder):  # only the folder is held in a variable: the file is found by its content
        with open(Path(folder) / "rows.jsonl") as f:
            return [json.loads(line) for line in f]

    (tmp_path / "rows.jsonl").write_text('{"a": 1}\n{"a": 2}\n{"a": 3,}\n')
    message = user_error_message(_raised(read_rows, tmp_path))
    assert message.startswith(f"{tmp_path / 'rows.jsonl'}:3: not valid JSON")


def test_unicode_error_names_file_and_line(tmp_path):
    def read(path):
        return Path(path).read_text(encoding="utf-8")

    path = tmp_path / "notes.txt"
    path.write_bytes(b"line one\nline two\nna\xefve\n")
    message = user_error_message(_raised(read, path))
    assert message == f"{path}:3: not UTF-8 text (byte 0xef at column 3): re-save the file as UTF-8"


def test_truncated_safetensors_names_file_and_first_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "weights.safetensors"
    save_file({"a.weight": torch.ones(64), "b.weight": torch.ones(64), "c.weight": torch.ones(64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-300])  # c (256 bytes) and part of b are gone
    exc = _raised(load_file, str(path))
    assert type(exc).__name__ == "SafetensorError"
    message = user_error_message(exc)
    assert message.startswith(f"{path}: truncated file: tensor 'b.weight' (and 1 more tensors) lies past its end")
    path.write_bytes(data[:5])
    assert "no header" in user_error_message(_raised(load_file, str(path)))


def test_missing_file_and_full_disk_are_user_errors():
    import errno

    assert user_error_message(FileNotFoundError(errno.ENOENT, "No such file", "/x/y.jsonl")) == \
        "/x/y.jsonl: no such file or folder: check the path"
    assert "no space left" in user_error_message(OSError(errno.ENOSPC, "No space left on device", "/out/a"))
    assert user_error_message(OSError(errno.EIO, "I/O error")) is None  # not something the user can fix
    assert user_error_message(RuntimeError("boom")) is None
    assert user_error_message(UserError("first\nsecond")) == "first second"  # always one line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda(capsys):
    for command in ("eval", "generate"):
        extra = ["--data", "arith", "--n", "1"] if command == "eval" else ["--prompt", "hi"]
        code, err = run(capsys, command, "--model", MISSING_MODEL, "--device", "cuda", *extra)
        assert code == 2 and "CUDA is not available" in one_line(err, command)
    # The same from torch itself, where a command does not check first (qerl train, quantize, bench):
    exc = _raised(lambda: torch.zeros(1, device="cuda"))
    message = user_error_message(exc, argparse.Namespace(device="cuda:0"))
    assert message.startswith("--device cuda:0 was asked for, but CUDA is not available") and "--device cpu" in message


# ---- an adapter of another model --------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Tiny Llamas of hidden size 64 and 32, and a LoRA adapter of the first."""
    from test_grpo import save_tiny_llama  # shared tiny-model helper

    from qerl_lib.models.loader import load_model
    from qerl_lib.models.lora import attach_lora, save_adapters

    root = tmp_path_factory.mktemp("two-models")
    wide = save_tiny_llama(root / "wide", hidden=64, layers=2, heads=4, kv_heads=2)
    narrow = save_tiny_llama(root / "narrow", hidden=32, layers=2, heads=4, kv_heads=2)
    save_adapters(attach_lora(load_model(wide), rank=4), root / "adapter")
    return root


def test_adapter_of_another_model_names_the_tensor(two_models, capsys):
    code, err = run(capsys, "eval", "--model", two_models / "narrow", "--lora", two_models / "adapter",
                    "--data", "arith", "--n", "1", "--device", "cpu", "--quiet")
    line = one_line(err, "eval")
    assert code == 2 and f"adapter {two_models / 'adapter'} does not fit" in line
    assert "lora_A" in line and "[4, 64] in the adapter but [4, 32] in the model" in line


def test_truncated_adapter_names_the_file(two_models, tmp_path, capsys):
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(two_models / "adapter", adapter)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, err = run(capsys, "eval", "--model", two_models / "wide", "--lora", adapter,
                    "--data", "arith", "--n", "1", "--device", "cpu", "--quiet")
    line = one_line(err, "eval")
    assert code == 2 and f"{weights}: truncated file: tensor" in line


# ---- --device of the commands that load a model themselves ---------------------------------------


@pytest.mark.parametrize("device, match", [
    ("bogus", "--device bogus: not a device torch knows: use auto, cpu, cuda or cuda:N"),
    ("meta", "--device meta: the kit runs on cpu or cuda"),
], ids=["unknown", "not-cpu-or-cuda"])
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["eval", "--data", "arith", "--n", "2"]],
                         ids=["generate", "eval"])
def test_a_device_the_kit_cannot_use_is_one_line_before_the_model_loads(capsys, command, device, match):
    code, err = run(capsys, command[0], "--model", MISSING_MODEL, *command[1:], "--device", device)
    assert code == 2 and match in one_line(err, command[0])


def test_cuda_n_must_name_a_visible_gpu_which_becomes_current(monkeypatch):
    from qerl_lib.cli.devices import resolve_cli_device

    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda:1 but CUDA is not available: use --device cpu"):
        resolve_cli_device("cuda:1")
    assert resolve_cli_device("auto") == resolve_cli_device(None) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    with pytest.raises(UserError, match=r"--device cuda:2: this machine has 2 visible GPU\(s\): use cuda:0 to cuda:1"):
        resolve_cli_device("cuda:2")
    assert resolve_cli_device("cuda") == resolve_cli_device("auto") == torch.device("cuda") and made_current == []
    # the kit's kernels launch on the current device's stream: an explicit GPU becomes the current one
    assert resolve_cli_device("cuda:1") == torch.device("cuda", 1) and made_current == [torch.device("cuda", 1)]


def test_outputs_never_replace_their_inputs_or_existing_files(tmp_path, capsys):
    """`qerl data` refuses an --out that exists (unless --force) or is its --path, and an empty input; `qerl eval`
    an output that is its --path; `qerl plot-run` / `plot-steps` an --out that is an input or not a .png. Each
    input is byte-equal afterwards (these once replaced the problems, the metrics or the JSON being read)."""
    data = write_jsonl(tmp_path / "in.jsonl", [GOOD, {**GOOD, "question": "b"}])
    before = data.read_bytes()
    cases = [
        (["data", "gsm8k", "--path", data, "--n", "1", "--out", data], "is the input"),
        (["data", "gsm8k", "--path", data, "--out", data, "--force"], "is the input"),
        (["data", "arith", "--n", "2", "--out", data], "already exists: pass --force"),
        (["data", "arith", "--n", "0", "--out", tmp_path / "new.jsonl"], "--n must be >= 1"),
        (["eval", "--model", MISSING_MODEL, "--data", "file", "--path", data, "--records", data], "is the input"),
        (["eval", "--model", MISSING_MODEL, "--data", "file", "--path", data, "--json", data], "is the input"),
    ]
    for argv, match in cases:
        code, err = run(capsys, *argv)
        assert code == 2 and match in one_line(err, argv[0]), (argv, err)
        assert data.read_bytes() == before, argv
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = run(capsys, "data", "gsm8k", "--path", empty, "--out", tmp_path / "g.jsonl")
    assert code == 2 and not (tmp_path / "g.jsonl").exists(), err
    code, _ = run(capsys, "data", "arith", "--n", "2", "--out", data, "--force")
    assert code == 0 and data.read_bytes() != before  # --force replaces, as asked

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text('{"step": 1, "reward": 0.5}\n')
    for out, match in ((metrics, "does not end in .png"), (run_dir / "x.txt", "does not end in .png")):
        code, err = run(capsys, "plot-run", run_dir, "--out", out)
        assert code == 2 and match in one_line(err, "plot-run"), err
    assert metrics.read_text() == '{"step": 1, "reward": 0.5}\n'
    (run_dir / "run.json").write_text('{"a": 1}')
    code, err = run(capsys, "plot-run", run_dir, "--out", tmp_path / "f.png")
    assert code == 2 and "is not a run.json written by `qerl train`" in one_line(err, "plot-run"), err
    steps = tmp_path / "steps.json"
    steps.write_text('{"rows": []}')
    code, err = run(capsys, "plot-steps", steps, "--out", steps)
    assert code == 2 and "does not end in .png" in one_line(err, "plot-steps") and steps.read_text() == '{"rows": []}'


def test_foreign_run_files_give_one_line_errors(tmp_path, capsys):
    """`train --resume` on a run.json not written by `qerl train`, and `plot-run` on a run whose metrics file has no
    step yet, print one line naming the fix (they raised KeyError / ValueError tracebacks)."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "run.json").write_text('{"a": 1}')
    code, err = run(capsys, "train", "--preset", "smollm2-arith-cpu", "--resume", "--out", foreign)
    assert code == 2 and "is not a run.json written by `qerl train`" in one_line(err, "train"), err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    code, err = run(capsys, "plot-run", empty, "--out", tmp_path / "f.png")
    assert code == 2 and "train at least one step first" in one_line(err, "plot-run"), err


def test_flag_errors_are_one_line_and_come_before_any_model_or_write(tmp_path, capsys):
    """Bad values of list flags, sampling flags, adapter folders and target files are one line naming the flag and
    the fix, found before a model is looked up (`MISSING_MODEL` would fail otherwise) and before anything is
    written (these were tracebacks, argparse's "invalid _int_list value", or checks made after the model loaded)."""
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"a": 1}')
    bin_only = tmp_path / "bin_adapter"
    bin_only.mkdir()
    (bin_only / "adapter_config.json").write_text("{}")
    (bin_only / "adapter_model.bin").write_bytes(b"\x80")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    gguf = tmp_path / "bad.gguf"
    gguf.write_bytes(b"")
    data = write_jsonl(tmp_path / "p.records.jsonl", [GOOD])
    spec = Path(__file__).resolve().parents[1] / "data" / "sweeps" / "tiny.toml"
    m = ["--model", MISSING_MODEL]
    cases = [
        (["bench", "rollout", "--batch", "0"], "bench", "--batch, --prompt-len and --repeats must be >= 1"),
        (["bench", "rollout", "--models", "foo"], "bench", "unknown model 'foo' in --models"),
        (["bench", "rollout", "--batch", "a,b"], "bench rollout", "expected comma-separated integers, got 'a,b'"),
        (["bench", "rollout", "--merge", wrong], "bench", "is not a results file of `qerl bench rollout --json`"),
        (["bench", "gemm", "--m", "0"], "bench gemm", "expected comma-separated integers >= 1, got '0'"),
        (["calibrate", *m, "--levels", "a,b"], "calibrate", "--levels takes comma-separated int values"),
        (["calibrate", *m, "--levels", "0"], "calibrate", "--levels takes comma-separated levels from"),
        (["calibrate", *m, "--temperatures", "-1"], "calibrate", "--temperatures takes comma-separated temperatures"),
        (["sweep", spec, "--seeds", "a,b", "--check"], "sweep", "--seeds takes comma-separated int values"),
        (["generate", *m, "--prompt", "hi", "--lora", tmp_path / "nope"], "generate", "adapter folder"),
        (["generate", *m, "--prompt", "hi", "--temperature", "-1"], "generate", "temperature must be >= 0"),
        (["generate", *m, "--prompts", empty], "generate", "holds no prompts: write one user message per line"),
        (["eval", *m, "--n", "2", "--lora", bin_only], "eval", "has no adapter_model.safetensors"),
        (["eval", *m, "--data", "file", "--path", empty], "eval", "the dataset is empty: pass a GSM8K-schema"),
        (["eval", *m, "--data", "file", "--path", data, "--json", tmp_path / "p.json"], "eval", "is the input"),
        (["export", *m, "--lora", tmp_path / "nope", "--out", tmp_path / "o"], "export", "does not exist"),
        (["export", *m, "--lora", tmp_path / "nope", "--out", tmp_path / "o", "--merge", "--requantize"], "export",
         "not allowed with argument"),
        (["prepare-model", "--gguf", gguf, "--out", tmp_path / "pm"], "prepare-model",
         "pass a complete SmolLM2-family GGUF file as --gguf"),
        (["results", "--readme", tmp_path], "results", "is a folder: pass the Markdown file"),
    ]
    for argv, command, match in cases:
        code, err = run(capsys, *argv)
        assert code == 2 and match in one_line(err, command), (argv, err)
    assert data.read_text() == json.dumps(GOOD) + "\n" and not (tmp_path / "p.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "bin_adapter", "empty.jsonl", "p.records.jsonl",
                                                          "wrong.json"]


def test_claims_checks_its_readme_before_writing_claims_json(tmp_path, capsys):
    """A wrong `qerl claims --readme` changes nothing: claims.json is not written (it was, before the error)."""
    import shutil

    results = tmp_path / "results"
    shutil.copytree(Path(__file__).resolve().parents[1] / "results" / "claims", results / "claims")
    no_block = tmp_path / "notes.md"
    no_block.write_text("# notes\n")
    for readme, match in ((tmp_path / "nope.md", "no such file"), (tmp_path, "is a folder"),
                          (no_block, "add them where the table goes")):
        code, err = run(capsys, "claims", "--results-dir", results, "--readme", readme)
        assert code == 2 and match in one_line(err, "claims"), err
        assert not (results / "claims.json").exists()
    assert no_block.read_text() == "# notes\n"
