"""The rollout phase's memory from the architecture (train/memory.py), against real tensors and the engine,
and the Qwen2.5 presets sized by it for one 80 GB GPU."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_lib.engine.continuous import headroom_columns
from qerl_lib.engine.rollout import RolloutEngine
from qerl_lib.models.loader import build_random_model, storage_bytes
from qerl_lib.paths import load_model_config
from qerl_lib.train.memory import (ROLLOUT_BUDGET_BYTES, base_weight_bytes, kv_cache_bytes, merged_copy_bytes,
                                   rollout_phase_bytes, rollout_rows_that_fit)
from qerl_lib.train.presets import PRESETS

# a Qwen2 architecture small enough for a CPU, with the real one's features: GQA, q/k/v biases, untied lm_head
TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=160,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
            max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("arch") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_weight_bytes_equal_a_built_models_tensors(tiny_config, base):
    model = build_random_model(tiny_config, dtype=torch.bfloat16, nvfp4=base == "nvfp4", init="random_codes")
    rotary = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rotary" in n)
    held = storage_bytes(list(model.parameters()) + list(model.buffers()), set()) - rotary
    assert base_weight_bytes(TINY, base) == held


def test_kv_cache_bytes_equal_the_engines_cache(tiny_config):
    model = build_random_model(tiny_config, dtype=torch.float32)
    for backend, rows, prompt, new in (("eager", 3, 7, 5), ("graphs", 3, 7, 5), ("graphs", 9, 300, 40)):
        engine = RolloutEngine(model, decode_backend=backend, keep_alive=True)
        engine.generate([[1] * prompt] * rows, new, temperature=1.0, seed=0, stop_token_ids=[])
        if backend == "eager":  # exact rows and columns; the graph path rounds both up to its buckets
            expected = kv_cache_bytes(TINY, rows, prompt + new - 1, length_step=1, buckets=(rows,), dtype_bytes=4)
        else:
            expected = kv_cache_bytes(TINY, rows, prompt + new - 1, dtype_bytes=4)
        assert engine.cache.nbytes == expected, (backend, rows, prompt, new)
    # continuous batching (more prompts than rows): the headroom columns on top
    engine = RolloutEngine(model, decode_backend="graphs", keep_alive=True)
    engine.generate([[1] * 300] * 20, 40, temperature=1.0, seed=0, stop_token_ids=[], max_batch=9)
    assert engine.cache.nbytes == kv_cache_bytes(TINY, 9, 300 + 40 - 1 + headroom_columns(), dtype_bytes=4)


def test_rows_that_fit_is_the_largest_power_of_two_under_the_budget():
    arch = load_model_config("qwen2.5-32b")
    rows = rollout_rows_that_fit(arch, "nvfp4", 256, 4096)
    assert rollout_phase_bytes(arch, "nvfp4", rows, 256, 4096)["total"] <= ROLLOUT_BUDGET_BYTES
    assert rollout_phase_bytes(arch, "nvfp4", 2 * rows, 256, 4096)["total"] > ROLLOUT_BUDGET_BYTES
    # 256 KiB per cached token at 32B: 64 rows of 256 + 4096 tokens are 68 GiB of cache alone
    assert kv_cache_bytes(arch, 64, 256 + 4096 - 1) == 64 * 2 * 64 * 8 * 4352 * 128 * 2


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("qwen2.5-")])
def test_every_qwen_preset_rolls_out_within_80_gb(name):
    """The preset's rollout_batch rows of max_prompt_tokens + max_completion_length tokens (plus the continuous-
    batching headroom: a step's 128 completions queue for the rows), with an NVFP4 base
    (modes nvfp4 and qerl) and, up to 14B, a bf16 one (lora), fit ROLLOUT_BUDGET_BYTES."""
    preset = PRESETS[name]
    size = name.split("-")[1]
    arch = load_model_config(f"qwen2.5-{size}")
    for base in ("nvfp4", "bf16") if size != "32b" else ("nvfp4",):
        plan = rollout_phase_bytes(arch, base, preset.rollout_batch, preset.max_prompt_tokens,
                                   preset.max_completion_length, continuous=True)
        assert plan["total"] <= ROLLOUT_BUDGET_BYTES, (name, base, {k: v / 2**30 for k, v in plan.items()})


def test_merged_copy_bytes_equal_the_engines_copies(tiny_config):
    """``lora_merge``: the engine's merged copies of a bf16 base with adapters on all seven projections hold exactly
    `merged_copy_bytes` (every decoder Linear's weight and bias once more)."""
    from tests.test_engine_merged import adapters_for

    model = build_random_model(tiny_config, dtype=torch.bfloat16)
    engine = RolloutEngine(model, lora_merge=True, keep_alive=True)
    engine.generate([[1] * 5] * 2, 3, temperature=1.0, seed=0, stop_token_ids=[], lora=adapters_for(model))
    assert engine._forward.merged.nbytes == merged_copy_bytes(TINY) > 0
    plan = rollout_phase_bytes(TINY, "bf16", 2, 5, 3, lora_merge=True)
    assert plan["merged_copy"] == merged_copy_bytes(TINY)
    assert plan["total"] == rollout_phase_bytes(TINY, "bf16", 2, 5, 3)["total"] + plan["merged_copy"]
    with pytest.raises(ValueError, match="bf16 base"):
        rollout_phase_bytes(TINY, "nvfp4", 2, 5, 3, lora_merge=True)


def test_merged_rollout_presets_keep_the_rows_that_fit_beside_the_copy():
    """`make_config(..., rollout_lora_merge=True)` re-sizes a Qwen preset's rollout rows with the copy counted: the
    7B preset keeps its 128 rows (12.2 GiB of copy), 14B falls to the rows that fit, 32B is refused in one line."""
    from qerl_lib.errors import UserError
    from qerl_lib.train.presets import make_config

    for size in ("3b", "7b", "14b"):
        plain = make_config(f"qwen2.5-{size}-gsm8k", mode="lora")
        merged = make_config(f"qwen2.5-{size}-gsm8k", mode="lora", rollout_lora_merge=True)
        arch = load_model_config(f"qwen2.5-{size}")
        plan = rollout_phase_bytes(arch, "bf16", merged.rollout_batch, 256, 4096, continuous=True, lora_merge=True)
        assert plan["total"] <= ROLLOUT_BUDGET_BYTES
        assert merged.rollout_batch == min(plain.rollout_batch,
                                           rollout_rows_that_fit(arch, "bf16", 256, 4096, continuous=True,
                                                                 lora_merge=True))
    assert make_config("qwen2.5-7b-gsm8k", mode="lora", rollout_lora_merge=True).rollout_batch == 128
    assert make_config("qwen2.5-14b-gsm8k", mode="lora", rollout_lora_merge=True).rollout_batch < 32
    # rows set by hand stay as set
    assert make_config("qwen2.5-14b-gsm8k", mode="lora", rollout_lora_merge=True, rollout_batch=32).rollout_batch == 32
    with pytest.raises(UserError, match="drop --rollout-lora-merge"):
        make_config("qwen2.5-32b-gsm8k", mode="lora", rollout_lora_merge=True)
