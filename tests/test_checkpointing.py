"""Partial gradient checkpointing (`train/checkpointing.py`): which decoder layers recompute in the backward,
and the gradients unchanged (the trainer applying it at every step: tests/test_grpo.py)."""

from __future__ import annotations

import pytest
import torch

from qerl_lib.errors import UserError
from qerl_lib.train.checkpointing import checkpointed_layers, recompute_only


def tiny_qwen2(layers: int = 4):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).float()


def count_forwards(layers) -> list[int]:
    """A live list of how many times each layer's ``forward`` runs (a wrapper, not a forward hook: torch's
    non-reentrant checkpoint does not fire hooks when it recomputes)."""
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        def counted(*args, _forward=layer.forward, _i=i, **kwargs):
            calls[_i] += 1
            return _forward(*args, **kwargs)
        layer.forward = counted
    return calls


def forward_backward(model, ids):
    """One loss forward and backward; returns (forward calls per decoder layer, every parameter's gradient)."""
    layers = checkpointed_layers(model)
    calls = count_forwards(layers)
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    for layer in layers:
        del layer.forward  # back to the class's method
    return calls, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True])
def test_only_the_first_n_layers_recompute_and_gradients_are_unchanged(reentrant):
    model = tiny_qwen2(4)
    model.train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    _, plain = forward_backward(model, ids)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls_all, grads_all = forward_backward(model, ids)
    assert calls_all == [2, 2, 2, 2]  # the forward, then the recompute in the backward
    assert recompute_only(model, 1) == 1
    calls_one, grads_one = forward_backward(model, ids)
    assert calls_one == [2, 1, 1, 1]
    assert recompute_only(model, 0) == 0
    assert forward_backward(model, ids)[0] == [1, 1, 1, 1]
    for name, g in plain.items():  # CPU float32: the recompute gives the same values, so the same gradients
        assert torch.equal(grads_all[name], g) and torch.equal(grads_one[name], g), name


def test_enabling_checkpointing_again_resets_every_layer_and_none_leaves_them():
    """Why the trainer applies it at every step: the model-wide switch (which TRL flips around its no-grad
    forwards) sets every layer's flag again."""
    model = tiny_qwen2(3)
    model.gradient_checkpointing_enable()
    assert recompute_only(model, 1) == 1
    model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable()
    assert [layer.gradient_checkpointing for layer in checkpointed_layers(model)] == [True] * 3
    assert recompute_only(model, None) == 3
    assert recompute_only(model, 10) == 3  # more than the model has: all of them


def test_bad_counts_and_models_without_layers_are_clear_errors():
    model = tiny_qwen2(2)
    for bad in (-1, True, 1.5):
        with pytest.raises(UserError, match="non-negative number of decoder layers"):
            recompute_only(model, bad)
    with pytest.raises(UserError, match="no decoder layers"):
        recompute_only(torch.nn.Linear(2, 2), 1)


def test_train_config_checks_checkpoint_layers():
    from qerl_lib.train.presets import make_config

    assert make_config("smollm2-arith", gradient_checkpointing=True, checkpoint_layers=0).checkpoint_layers == 0
    with pytest.raises(UserError, match="gradient checkpointing, which is off"):
        make_config("smollm2-arith", gradient_checkpointing=False, checkpoint_layers=4)
    with pytest.raises(UserError, match="non-negative number"):
        make_config("smollm2-arith", gradient_checkpointing=True, checkpoint_layers=-2)


def test_bench_case_refuses_checkpoint_layers_without_checkpointing():
    from qerl_lib.studies.train_bench import TrainCase

    with pytest.raises(UserError, match="gradient checkpointing, which is off"):
        TrainCase(gradient_checkpointing=False, checkpoint_layers=4)

