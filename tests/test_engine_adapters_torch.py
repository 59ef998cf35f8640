"""The engine's plain-torch adapters (``engine/adapters.add_lora_torch``: the prefill's LoRA on the GPU, every LoRA
on the CPU): the expand adds into a fused group's column slices in place, and gives the bits of the out-of-place
``addmm`` on a contiguous copy (the sum it replaced), on fresh random inputs in float32 and bf16; an output whose
rows do not flatten to a view keeps the out-of-place path; a member without an adapter is left as it was."""

from __future__ import annotations

import pytest
import torch

from qerl_lib.engine.adapters import add_lora_torch


def _group(dtype, seed, widths=(48, 16, 16), ranks=(8, None, 4), hidden=32, batch=3, seq=5):
    """A fused output ``[batch, seq, sum(widths)]``, its members as column-slice views, and a layout entry."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(batch, seq, sum(widths), generator=g).to(dtype)
    x = torch.randn(batch, seq, hidden, generator=g).to(dtype)
    a_rows = sum(r for r in ranks if r)
    a_cat = (torch.randn(a_rows, hidden, generator=g) / hidden ** 0.5).to(dtype)
    slots, start, col = [], 0, 0
    outs = []
    for width, rank in zip(widths, ranks):
        outs.append(full[..., col:col + width])
        col += width
        if rank is None:
            slots.append(None)
            continue
        b = torch.randn(width, rank, generator=g).to(dtype)
        slots.append((start, start + rank, b, 0.5 + rank / 16))
        start += rank
    return full, x, (a_cat, slots), outs


def _reference(entry, x, outs):
    """The sum before the in-place change: ``addmm`` on a contiguous copy of each member's rows."""
    a_cat, slots = entry
    xa = x.reshape(-1, x.shape[-1]) @ a_cat.t()
    ref = []
    for o, slot in zip(outs, slots):
        o = o.contiguous().clone()
        if slot is not None:
            s, e, b, scale = slot
            o = torch.addmm(o.reshape(-1, o.shape[-1]), xa[:, s:e], b.t(), alpha=scale).view(o.shape)
        ref.append(o)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_slices_get_the_adapters_in_place_with_the_out_of_place_bits(dtype, seed):
    full, x, entry, outs = _group(dtype, seed)
    before = full.clone()
    ref = _reference(entry, x, outs)
    got = add_lora_torch(entry, x, None, list(outs))
    for j, (g, r) in enumerate(zip(got, ref)):
        assert torch.equal(g, r), j
    # in place: the fused tensor itself now holds the sums, and each returned output is still its slice
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, outs))
    assert torch.equal(full[..., 48:64], before[..., 48:64])  # the member without an adapter: untouched
    assert not torch.equal(full[..., :48], before[..., :48])


def test_an_output_whose_rows_are_not_a_view_keeps_the_out_of_place_sum():
    full, x, entry, outs = _group(torch.float32, 3)
    outs = [o.transpose(0, 1) for o in outs]  # [seq, batch, width]: its rows cannot flatten without a copy
    x = x.transpose(0, 1)
    before = full.clone()
    ref = _reference(entry, x, outs)
    got = add_lora_torch(entry, x, None, list(outs))
    assert all(torch.equal(g, r) for g, r in zip(got, ref))
    assert torch.equal(full, before)  # nothing written through the non-view


@pytest.mark.cuda
def test_cuda_prefill_sized_gate_up_slices_in_place_within_one_rounding():
    """A prefill's gate/up at a 7B-like width ratio (512 rows, two 2048-wide members of one 4096-wide output): cuBLAS
    takes the slices with their row stride as the leading dimension. The kernel it picks may differ from the
    contiguous copy's, so the sums agree within one bf16 rounding (2**-7 relative to each output's scale), not bit
    for bit; and the fused output holds them."""
    full, x, entry, outs = _group(torch.bfloat16, 4, widths=(2048, 2048), ranks=(16, 16), hidden=512, batch=2,
                                  seq=256)
    full, x = full.cuda(), x.cuda()
    a_cat, slots = entry
    entry = (a_cat.cuda(), [(s, e, b.cuda(), c) for s, e, b, c in slots])
    outs = [full[..., :2048], full[..., 2048:]]
    ref = _reference(entry, x, outs)
    got = add_lora_torch(entry, x, None, list(outs))
    for g, r in zip(got, ref):
        scale = r.float().abs().amax().item()
        assert (g.float() - r.float()).abs().amax().item() <= scale * 2 ** -7
    assert torch.equal(torch.cat(got, dim=-1), full)
