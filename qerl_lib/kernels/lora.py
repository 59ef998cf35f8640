"""Unmerged LoRA in the decode step: two small Triton kernels per projection group.

What is computed
----------------
For a group of projections that read the same input ``x [M, K]`` (q/k/v, o, gate/up, down) and
whose base outputs sit side by side in one tensor ``out [M, N]`` (``models/fused.py``), every
member ``j`` with an adapter adds ``scale_j * (x @ A_j^T) @ B_j^T`` to its columns. The plain-torch
form (``reference_apply``, and what the engine runs on CPU and in prefill) is one matmul for all
the members' A matrices stacked (``xa = x @ A_cat^T``, rounded to the activation dtype) and one
``addmm`` per member. At decode sizes (M = 8 tokens, rank 16) those are tiny matmuls: their cost
is launches, ramp-up and tails (on an H100, 7B NVFP4, batch 8: 1.9 ms more per step over 308 such
launches, ~6 us each), so a rank-16 adapter cost the decode step ~38% of its tokens/s while its
bytes are < 1% of the weights'. With these kernels it costs 11% (dev/LOG.md, section 17).

How (``apply_``)
----------------
* ``_shrink_kernel``: ``xa = x @ A_cat^T``. Programs tile (16 ranks) x (a slice of K) x (rows),
  ~256 columns of K each at batch 8 (128 and 256 measured equal and best; 512 and 1024 slower, dev/LOG.md
  section 17), ~512 above (``split_rule``; section 27); each writes its fp32 partial. Who adds the
  partials depends on the rank and the rows (``EXPAND_SUMS_UP_TO_RANK``): at small ranks, and at any
  rank above 8 rows, every expand program sums the bytes it needs itself; at larger ranks at batch 8
  the last slice of a block to arrive (an atomic counter, reset by that program) adds them once and
  writes ``xa``. Either way in slice order (deterministic bits) and rounded to the activation dtype,
  as the torch path's ``xa`` tensor is.
* Where the group's FP4 GEMM split K (on a Hopper GPU with the Qwen2.5 shapes, ``launch_rule``: the Triton kernel
  on all but gate/up at 9-24 and 129-192 rows, the Gluon kernels on down at 24-128 and on q/k/v and o at 25-32 and
  97-128), the expand can also finish that GEMM (``expand_(..., base=SplitBase)``, from ``fp4_gemm.fp4_linear(...,
  defer_reduce=)``): each program sums its tile's fp32 partials exactly as ``fp4_gemm.reduce_splits`` does (slice
  order, ``* 2^8/gs``, one rounding, bias, one rounding) before adding the adapters, so the GEMM's reduction
  launch is saved and the bits are the same. Only where the adapters cover every output column, and the GEMM cut K
  into at most ``EXPAND_SUMS_SLICES_UP_TO`` slices: on an H100 the fold lost 3.8% of tokens/s at batch 32, where
  q/k/v's and o's 28-36 expand programs each added 7-10 slices that the reduction spread over 144 programs
  (dev/LOG.md section 38). The engine's switch: ``QERL_LORA_SUMS_SPLITS``.
* ``_expand_kernel``: programs tile the output columns, one member per tile (the member's rank
  offset, rank and scale come from small per-tile tables); each multiplies ``xa`` by its ``B``
  tile and adds ``scale *`` that to ``out`` in fp32, rounding once (as ``addmm`` does). All members
  of a group share one launch: 2 launches per group instead of 1 + members.
* ``apply_`` is ``shrink_`` then ``expand_``. A kernel that reads the group's output anyway may take
  ``shrink_``'s result (``Shrunk``) and add the expand itself with ``member_xa``: the engine's SiLU x up
  does so for gate/up above ``FEW_ROWS`` rows (``engine/glue.py``). Folding o's and down's expands into
  the residual + RMSNorm kernel (one program per row) measured slower (dev/LOG.md section 29), and so did
  the shrink and the expand in one launch at batch 8 (roles by an atomic ticket, the expand's programs spinning
  until the shrink's slices are done): 12-30% fewer tokens/s than two launches (section 41).
* ``B`` lives in one zero-padded buffer per group, ``[N, RP]`` with ``RP`` the largest rank
  rounded up to a power of two (>= 16, the tensor-core minimum); the engine's per-member ``B``
  buffers are views into it, so refreshing the adapters each call updates both paths.

Programmatic dependent launch (``kernels/pdl.py``), and one deliberate exception to its rule
-------------------------------------------------------------------------------------------------
The kit's decode kernels read nothing written by the previous kernel before ``gdc_wait``. The
shrink kernel does: it runs right after the base GEMM and reads ``x``, which the kernel *before*
the GEMM wrote. That is safe because a kernel can only start early once every program of the
kernel before it has called ``gdc_launch_dependents``, which the kit's kernels do right after
their own ``gdc_wait`` (and kernels without PDL do implicitly when they finish): by then the
GEMM's predecessor has finished and its writes are visible. ``x`` is read with ``.cg`` (through
L2, not a possibly stale L1 line). So the shrink overlaps the base GEMM instead of following it;
it also lets its dependent launch at once, and waits for the GEMM before it writes anything (the
caching allocator may hand the GEMM's just-freed split-K workspace to the shrink's output, and
"shrink done" must imply "GEMM done" for the expand kernel). The expand kernel loads its ``B``
tile (constant during a rollout) before its wait, then reads ``xa`` and ``out``. This assumes the
kernel just before the shrink is the group's GEMM, which is how ``engine/forward.py`` calls it;
``apply_`` is not a general-purpose op (``use_pdl=False`` gives the conservative order for any
other use). A CUDA test checks that rollouts are bit-identical with PDL on and off.

Two more ways, for NVFP4 groups whose GEMM runs on the mma.sync kernel (decode, M <= 8; the engine
picks them in ``engine/adapters.gemm_lora_epilogue``). That kernel can add the adapters itself in the
same launch (``GroupPlan.epilogue()``, ``kernels/mma.cu`` "LoRA"), so neither kernel here runs
(``lora_in_gemm``; off by default: on an H100 it measured slower than these two launches). Or its
launch only makes ``xa`` beside its tiles (``GroupPlan.epilogue(expand=False)``; ``QERL_LORA_SHRINK_IN_GEMM=1``),
and the expand here follows it (``given_xa``): the NVFP4 counterpart of the bf16 base's A rows, one launch a
group instead of two. Off by default: on an H200 its LoRA CTAs still add ~3 us to each GEMM launch, where the
shrink here runs beside the GEMM; at 7B the step came out 2-4% slower at ranks 16 and 32 and 3% faster at 64
(dev/LOG.md sections 50-51). A third, for groups that follow a norm: the norm kernel makes ``xa`` itself
(``engine/glue.norm_shrink``) and the GEMM adds it in its epilogue (``GroupPlan.epilogue(given=xa)``, ``mma.cu``
``LORA_GIVEN``: no LoRA CTAs, no wait), so the group has no LoRA launch at all (``QERL_LORA_SHRINK_IN_NORM=1``;
off by default: on an H200 the step came out slower, dev/LOG.md sections 66-67).

Where we deviate from vLLM (the paper's engine): vLLM's punica kernels (SGMV/BGMV shrink and
expand) serve many adapters per batch through an index per token; here one adapter serves the
whole batch (an RL rollout samples from one policy), so no per-token indirection, and each
group's members share one launch per stage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # Triton is optional: the CPU paths do not need it.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    gdc_launch_dependents = gdc_wait = None

from qerl_lib.kernels import pdl

if triton is not None:
    from qerl_lib.kernels.splitk import finish, summed_slices

MAX_M = 256  # rows above this (prefill) take the torch path: compute-bound matmuls, launches do not matter
RANK_BLOCK = 16  # ranks per shrink program, and the minimum padded rank (tensor-core tile)
BLOCK_K = 128
FEW_ROWS = 8  # up to this many rows of x (the batch-8 decode step) the launch shape below differs
K_PER_SPLIT = 256  # ~ columns of K per shrink program, at M <= FEW_ROWS
K_PER_SPLIT_MANY_ROWS = 512  # the same above FEW_ROWS (fewer partials for each expand program to add)
MAX_SPLITS = 32
BLOCK_N = 128  # output columns per expand program
# Warps per program (H100, 7B NVFP4, dev/LOG.md section 28). Alone, 4 shrink and 8 expand warps ran the pair 8-23%
# faster per layer than 1 and 4 (M = 32 at rank 64: ~1%); in the engine the 4-warp shrink cost batch 8 (r16 +20.3%
# per step against +13.4% with 1 warp: there it runs beside the mma.sync GEMM) and helped batch 32 / 64 (r16 +12.5% /
# +13.7% against +16.7% / +18.7% with 1 shrink and 4 expand warps).
SHRINK_WARPS = 4  # above FEW_ROWS rows
SHRINK_WARPS_FEW_ROWS = 1  # at most FEW_ROWS rows
# Who adds the K slices' partials: the expand kernel (each of its programs, for its member's ranks)
# up to this padded rank, the shrink kernel's last slice above it -- at M <= FEW_ROWS; above, always the
# expand kernel. Measured on an H100, 7B NVFP4 (dev/LOG.md sections 17 and 27): batch 8, rank 16 +13% per
# step vs +23%, rank 64 +36% vs +27%; batch 32 and 64, the expand kernel's sums won at ranks 16 and 64
# (K_PER_SPLIT_MANY_ROWS: rank 16 +16.7% / +18.9% vs +21.7% / +23.3%; rank 64 +22.9% / +24.9% vs +25.9% / +27.1%).
EXPAND_SUMS_UP_TO_RANK = 32
EXPAND_WARPS = 8
# The most K-slices of the group's FP4 GEMM that the expand kernel sums itself (``split_base``); more go to the
# reduction launch. H100, 7B + r16 (dev/LOG.md sections 38-39): with 7-10 slices (q/k/v and o on the Triton kernel
# at batch 32 then) the expand's 28-36 programs summing them cost 3.8% of the step; with the down projection's 4 the
# fold gained 0.9% / 0.4% at batch 32 / 64.
EXPAND_SUMS_SLICES_UP_TO = 4


@dataclass
class GroupPlan:
    """Everything the two kernels need for one projection group's adapters, on the device.

    ``a_cat [R, K]``: the present members' A matrices stacked (member j at rows
    ``r_start[j] : r_start[j] + rank[j]``). ``b_cat [N, RP]``: each present member's B in its own
    output columns' rows, zero in the padding and in absent members' rows. ``tiles [T, 3]`` (int32):
    per expand program, the first and last+1 output column and the member index.
    ``members``: ``(n_start, n_end, r_start, rank, scale)`` of each present member (host copy).
    """

    a_cat: torch.Tensor
    b_cat: torch.Tensor
    tiles: torch.Tensor
    r_start: torch.Tensor  # int32 [members]
    rank: torch.Tensor  # int32 [members]
    scale: torch.Tensor  # float32 [members]
    members: tuple[tuple[int, int, int, int, float], ...]
    counters: torch.Tensor  # int32, one per (row block, rank block) of the shrink; zero between calls
    bounds: torch.Tensor  # int32 [members, 4]: (n_start, n_end, r_start, rank), for the GEMM's LoRA epilogue
    sync: torch.Tensor  # int32 [4 + rank blocks of 16]: that epilogue's counters, zero between calls
    xa_workspace: torch.Tensor | None = None  # float32: where a shrink-only GEMM launch writes xa (allocated on use)

    def epilogue(self, expand: bool = True, given: torch.Tensor | None = None):
        """These adapters as the mma.sync GEMM's ``LoraEpilogue``: added by the group's base GEMM itself, or with
        ``expand=False`` only ``xa`` made by that launch (into ``xa_workspace``), for ``given_xa`` and ``expand_``.
        ``given``: float32 ``xa [M, R]`` an earlier kernel wrote; the GEMM's epilogue only adds ``xa @ B^T``."""
        from qerl_lib.kernels.mma import LoraEpilogue

        if given is not None:
            return LoraEpilogue(self.a_cat, self.b_cat, self.bounds, self.scale, self.sync, given=given)
        if expand:
            return LoraEpilogue(self.a_cat, self.b_cat, self.bounds, self.scale, self.sync)
        if self.xa_workspace is None:
            self.xa_workspace = torch.empty(LoraEpilogue.workspace_numel(FEW_ROWS, self.a_cat.shape[0]),
                                            dtype=torch.float32, device=self.a_cat.device)
        return LoraEpilogue(self.a_cat, self.b_cat, self.bounds, self.scale, self.sync, expand=False,
                            workspace=self.xa_workspace)

    @property
    def n_total(self) -> int:
        return self.b_cat.shape[0]

    @property
    def padded_rank(self) -> int:
        return self.b_cat.shape[1]

    def covers_all(self) -> bool:
        """Whether the members with adapters cover every output column (``expand_``'s ``base`` needs it)."""
        return sum(n1 - n0 for n0, n1, _, _, _ in self.members) == self.n_total

    def b_view(self, i: int) -> torch.Tensor:
        """Member ``i``'s ``B [n_end - n_start, rank]`` as a view of ``b_cat``."""
        n0, n1, _, r, _ = self.members[i]
        return self.b_cat[n0:n1, :r]


def build_plan(a_cat: torch.Tensor, n_total: int, members, block_n: int = BLOCK_N) -> GroupPlan:
    """Allocate ``b_cat`` and the tile tables for ``members`` = ``[(n_start, n_end, r_start, rank, scale)]``
    (present members only, columns within ``[0, n_total)``, ranks within ``a_cat``'s rows)."""
    members = tuple((int(n0), int(n1), int(r0), int(r), float(s)) for n0, n1, r0, r, s in members)
    if not members:
        raise ValueError("build_plan: a group plan needs at least one member with an adapter")
    for n0, n1, r0, r, _ in members:
        if not (0 <= n0 < n1 <= n_total and 0 <= r0 and r >= 1 and r0 + r <= a_cat.shape[0]):
            raise ValueError(f"build_plan: member columns [{n0}, {n1}) of {n_total} or ranks [{r0}, {r0 + r}) "
                             f"of {a_cat.shape[0]} out of range")
    padded = max(RANK_BLOCK, 1 << (max(m[3] for m in members) - 1).bit_length())
    device = a_cat.device
    b_cat = torch.zeros(n_total, padded, dtype=a_cat.dtype, device=device)
    tiles = [(c, min(c + block_n, n1), j) for j, (n0, n1, _, _, _) in enumerate(members) for c in range(n0, n1, block_n)]
    return GroupPlan(a_cat, b_cat, torch.tensor(tiles, dtype=torch.int32, device=device),
                     torch.tensor([m[2] for m in members], dtype=torch.int32, device=device),
                     torch.tensor([m[3] for m in members], dtype=torch.int32, device=device),
                     torch.tensor([m[4] for m in members], dtype=torch.float32, device=device), members,
                     torch.zeros(_cdiv(MAX_M, RANK_BLOCK) * _cdiv(a_cat.shape[0], RANK_BLOCK),
                                 dtype=torch.int32, device=device),
                     torch.tensor([m[:4] for m in members], dtype=torch.int32, device=device),
                     torch.zeros(4 + _cdiv(a_cat.shape[0], RANK_BLOCK), dtype=torch.int32, device=device))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference_apply(out: torch.Tensor, x: torch.Tensor, plan: GroupPlan) -> torch.Tensor:
    """Plain torch, in place: ``out[:, n0:n1] += scale * (x @ A^T) @ B^T`` per member, with ``xa``
    rounded to the activation dtype and each member's add rounded once (``addmm``)."""
    xa = x @ plan.a_cat.t()
    for i, (n0, n1, r0, r, scale) in enumerate(plan.members):
        out[:, n0:n1] = torch.addmm(out[:, n0:n1], xa[:, r0:r0 + r], plan.b_view(i).t(), alpha=scale)
    return out


def supported(out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``apply_`` takes these tensors: CUDA (or Triton's interpreter on CPU, float32 only), 2-D,
    unit last stride, at most ``MAX_M`` rows, bf16/fp16 (float32 on the interpreter)."""
    if triton is None or out.dim() != 2 or x.dim() != 2 or out.shape[0] != x.shape[0] or x.shape[0] > MAX_M:
        return False
    if out.stride(-1) != 1 or x.stride(-1) != 1:
        return False
    if x.device.type == "cuda":
        return x.dtype in (torch.bfloat16, torch.float16) and out.dtype == x.dtype
    return interpreting() and x.dtype == torch.float32 and out.dtype == x.dtype


def split_rule(m: int, k: int, padded_rank: int) -> tuple[int, int, bool]:
    """The shrink's K-slices for ``m`` rows of ``x [m, k]``: ``(slices, columns per slice (a multiple of
    BLOCK_K), whether the shrink's last slice adds the partials)`` -- else each expand program does."""
    target = K_PER_SPLIT if m <= FEW_ROWS else K_PER_SPLIT_MANY_ROWS
    splits = max(1, min(MAX_SPLITS, _cdiv(k, target)))
    k_per = _cdiv(_cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = _cdiv(k, k_per)
    return splits, k_per, splits > 1 and m <= FEW_ROWS and padded_rank > EXPAND_SUMS_UP_TO_RANK


@dataclass(frozen=True)
class SplitBase:
    """A base GEMM's output still as fp32 K-slice partials (``fp4_gemm.fp4_linear``'s ``defer_reduce`` entry):
    ``ws [S, M, N]``, the weights' device global scale, the bias or None; ``expand_`` sums them."""

    ws: torch.Tensor
    global_scale: torch.Tensor
    bias: torch.Tensor | None


def split_base(deferred: list | None, out: torch.Tensor | None) -> SplitBase | None:
    """``fp4_linear``'s ``defer_reduce`` list -> the ``base`` of an expand writing ``out``, where one deferred
    reduction of at most ``EXPAND_SUMS_SLICES_UP_TO`` slices covers all of ``out``; any other deferred reductions
    (more slices, several launches, part of the columns, or no ``out`` to take them) run here instead, and the
    result is None."""
    if not deferred:
        return None
    if out is not None and len(deferred) == 1:
        ws, gs, bias, target = deferred[0]
        if (ws.shape[0] <= EXPAND_SUMS_SLICES_UP_TO and target.data_ptr() == out.data_ptr()
                and target.shape == out.shape and target.stride() == out.stride()):
            return SplitBase(ws, gs, bias)
    from qerl_lib.kernels.fp4_gemm import reduce_splits

    for job in deferred:
        reduce_splits(*job)
    return None


@dataclass
class Shrunk:
    """What ``shrink_`` leaves for the expand step: ``xa = x @ A_cat^T`` of ``m`` rows, either summed
    (``src [m, R]`` in the activation dtype, ``splits == 1``) or as ``splits`` fp32 K-slice partials
    ``src [splits, m, R]`` for the reader to add in slice order. ``early``: the kernels after it use PDL."""

    src: torch.Tensor
    splits: int
    m: int
    plan: GroupPlan
    block_m: int
    precision: str
    early: bool

    @property
    def row_stride(self) -> int:
        """Elements between rows of ``src`` (``R`` for partials; summed ``xa`` may be a strided view)."""
        return self.src.stride(-2)

    def member(self, n_start: int) -> tuple[int, int, float]:
        """``(r_start, rank, scale)`` of the member whose columns start at ``n_start``; ``(0, 0, 0.0)`` if
        that member has no adapter (its rows of ``b_cat`` are zero and rank 0 masks its ``xa``)."""
        for n0, _, r0, r, scale in self.plan.members:
            if n0 == n_start:
                return r0, r, scale
        return 0, 0, 0.0


def check_shapes(out: torch.Tensor, x: torch.Tensor, plan: GroupPlan) -> None:
    """Raise if ``out [M, N]`` and ``x [M, K]`` do not fit ``plan``."""
    if out.shape[1] != plan.n_total or x.shape[1] != plan.a_cat.shape[1]:
        raise ValueError(f"kernels/lora: out {list(out.shape)} / x {list(x.shape)} do not match the plan "
                         f"(N = {plan.n_total}, K = {plan.a_cat.shape[1]})")


def shrink_(x: torch.Tensor, plan: GroupPlan, use_pdl: bool | None = None) -> Shrunk:
    """The first launch of ``apply_``: ``x [M, K] @ A_cat^T`` (see ``apply_`` for when to call it)."""
    m, k = x.shape
    r_total = plan.a_cat.shape[0]
    splits, k_per, reduce_in_shrink = split_rule(m, k, plan.padded_rank)
    block_m, precision = _program_rows_and_precision(m, x.dtype)
    xa = torch.empty(m, r_total, dtype=x.dtype, device=x.device)
    partial = torch.empty(splits, m, r_total, dtype=torch.float32, device=x.device) if splits > 1 else xa
    early = pdl.use_for(x.device, use_pdl)
    _shrink_kernel[(triton.cdiv(r_total, RANK_BLOCK), splits, triton.cdiv(m, block_m))](
        x, plan.a_cat, partial, xa, plan.counters, m, k, r_total, k_per, x.stride(0), plan.a_cat.stride(0),
        SPLITS=splits, REDUCE=reduce_in_shrink, BLOCK_M=block_m, BLOCK_R=RANK_BLOCK, BLOCK_K=BLOCK_K,
        PRECISION=precision, PDL=early, launch_pdl=early,
        num_warps=SHRINK_WARPS_FEW_ROWS if m <= FEW_ROWS else SHRINK_WARPS)
    summed = splits == 1 or reduce_in_shrink
    return Shrunk(xa if summed else partial, 1 if summed else splits, m, plan, block_m, precision, early)


def given_xa(xa: torch.Tensor, plan: GroupPlan, use_pdl: bool | None = None) -> Shrunk:
    """``xa = x @ A_cat^T`` made by someone else, as ``shrink_``'s result for ``expand_`` (or a consumer kernel):
    the extra output columns of a bf16 base GEMM whose weight carries A as extra rows (``models/fused.py``,
    ``fuse_group(..., extra_rows=)``), or the float32 ``xa`` of an NVFP4 GEMM launch that also ran the shrink
    (``kernels/mma``, ``LoraEpilogue(expand=False)``), rounded to the activation dtype as the torch path's
    ``xa`` is. ``xa [M, R]`` needs a unit last stride; its row stride may be the GEMM output's."""
    m, r_total = xa.shape
    if r_total != plan.a_cat.shape[0] or xa.stride(-1) != 1:
        raise ValueError(f"kernels/lora.given_xa: xa {list(xa.shape)} (strides {xa.stride()}) must have the plan's "
                         f"{plan.a_cat.shape[0]} ranks as unit-stride columns")
    return Shrunk(xa, 1, m, plan, *_program_rows_and_precision(m, plan.b_cat.dtype), pdl.use_for(xa.device, use_pdl))


def _program_rows_and_precision(m: int, dtype: torch.dtype) -> tuple[int, str]:
    """Rows of x per program of the shrink and the expand at ``m`` rows, and their dots' input precision (exact
    float32 on the interpreter; tf32 is ignored for 16-bit inputs)."""
    return min(64, max(16, triton.next_power_of_2(m))), "ieee" if dtype == torch.float32 else "tf32"


def expand_(out: torch.Tensor, shrunk: Shrunk, base: SplitBase | None = None) -> torch.Tensor:
    """The second launch of ``apply_``: ``out += each member's scale * xa @ B^T``, in place. ``base``: ``out``
    is not written yet; its values are ``fp4_gemm.reduce_splits`` of these partials, which this launch sums."""
    plan, m = shrunk.plan, shrunk.m
    ws = bias = gs = out  # (unused without a base)
    slices = 0
    if base is not None:
        if tuple(base.ws.shape[1:]) != (m, plan.n_total) or not base.ws.is_contiguous() or not plan.covers_all():
            raise ValueError(f"kernels/lora.expand_: base partials {list(base.ws.shape)} must be contiguous "
                             f"[S, {m}, {plan.n_total}] and the adapters must cover every output column")
        ws, gs, slices = base.ws, base.global_scale, base.ws.shape[0]
        bias = base.bias if base.bias is not None else out
    _expand_kernel[(plan.tiles.shape[0], triton.cdiv(m, shrunk.block_m))](
        shrunk.src, plan.b_cat, out, plan.tiles, plan.r_start, plan.rank, plan.scale, ws, gs, bias, m,
        plan.a_cat.shape[0], shrunk.row_stride, plan.n_total, out.stride(0), plan.b_cat.stride(0), SPLITS=shrunk.splits,
        BLOCK_M=shrunk.block_m, BLOCK_N=BLOCK_N, RP=plan.padded_rank, PRECISION=shrunk.precision,
        BASE_SLICES=slices, HAS_BIAS=base is not None and base.bias is not None, INTERPRETED=not out.is_cuda,
        PDL=shrunk.early, launch_pdl=shrunk.early, num_warps=EXPAND_WARPS)
    return out


def apply_(out: torch.Tensor, x: torch.Tensor, plan: GroupPlan, use_pdl: bool | None = None,
           base: SplitBase | None = None) -> torch.Tensor:
    """In place: ``out [M, N] += each member's scale * (x [M, K] @ A^T) @ B^T`` (two launches:
    ``shrink_``, then ``expand_``; or ``shrink_`` and a kernel that reads ``out`` and adds the expand
    itself, as ``engine/glue.py``'s SiLU x up does).

    Call it right after the GEMM that wrote ``out`` (see the module docstring); ``use_pdl=False``
    launches both kernels plainly, for any other order. Check ``supported`` first. ``base``: ``expand_``'s."""
    check_shapes(out, x, plan)
    return expand_(out, shrink_(x, plan, use_pdl), base)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, p_ptr, xa_ptr, cnt_ptr, M, K, R, k_per, sx, sa, SPLITS: tl.constexpr,
                       REDUCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
        """Program (rank block, K slice, row block): its slice's partial ``x @ A^T``. With ``REDUCE``, the
        last of a block's slices to finish adds them all in slice order and writes ``xa`` in the
        activation dtype; without, the expand kernel adds them."""
        if PDL:  # x is visible already (module docstring); let the expand kernel launch and preload B
            gdc_launch_dependents()
        pid_r, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        ok_m, ok_r = rows < M, ranks < R
        ok = ok_m[:, None] & ok_r[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_lo = pid_s * k_per
        for k0 in range(k_lo, k_lo + k_per, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            ok_k = cols < K
            xk = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=ok_m[:, None] & ok_k[None, :], other=0.0,
                         cache_modifier=".cg")
            ak = tl.load(a_ptr + ranks[:, None] * sa + cols[None, :], mask=ok_r[:, None] & ok_k[None, :], other=0.0)
            acc = tl.dot(xk, tl.trans(ak), acc, input_precision=PRECISION)
        if PDL:  # write only once the GEMM has finished: its freed workspace may share our output's memory,
            gdc_wait()  # and "shrink done" then implies "GEMM done" for the expand kernel's wait
        xa_ptrs = xa_ptr + rows[:, None] * R + ranks[None, :]
        if SPLITS == 1:
            tl.store(xa_ptrs, acc.to(xa_ptr.dtype.element_ty), mask=ok)
        elif not REDUCE:
            tl.store(p_ptr + (pid_s * M + rows[:, None]) * R + ranks[None, :], acc, mask=ok)
        else:
            tl.store(p_ptr + (pid_s * M + rows[:, None]) * R + ranks[None, :], acc, mask=ok)
            tl.debug_barrier()  # every thread's partial is written before the program announces it
            counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_r
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:  # the last slice of this block
                total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for s in range(SPLITS):  # fixed order: deterministic bits
                    total += tl.load(p_ptr + (s * M + rows[:, None]) * R + ranks[None, :], mask=ok, other=0.0,
                                     cache_modifier=".cg")
                tl.store(xa_ptrs, total.to(xa_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(counter, 0)  # ready for the next call (and for a replayed graph)

    @triton.jit
    def member_xa(xa_ptr, rows, ok_m, r0, rank, M, R, sxa, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                  RP: tl.constexpr):
        """fp32 ``xa [rows, RP]`` of one member (ranks ``r0 .. r0 + rank``, zero above): ``SPLITS`` = 1 reads the
        summed ``xa`` (row stride ``sxa``), else adds that many fp32 K-slice partials ``[SPLITS, M, R]`` in slice
        order (deterministic bits; ``sxa`` is then ``R``). Round it to the activation dtype before use, as the
        torch path's ``xa`` tensor is."""
        rr = tl.arange(0, RP)
        ok_xa = ok_m[:, None] & (rr < rank)[None, :]
        xa = tl.zeros((BLOCK_M, RP), dtype=tl.float32)
        for s in range(SPLITS):
            xa += tl.load(xa_ptr + s * M * R + rows[:, None] * sxa + r0 + rr[None, :], mask=ok_xa,
                          other=0.0).to(tl.float32)
        return xa

    @triton.jit
    def _expand_kernel(xa_ptr, b_ptr, out_ptr, tiles_ptr, r_start_ptr, rank_ptr, scale_ptr, ws_ptr, gs_ptr, bias_ptr,
                       M, R, sxa, N, so, sb, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       RP: tl.constexpr, PRECISION: tl.constexpr, BASE_SLICES: tl.constexpr, HAS_BIAS: tl.constexpr,
                       INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        """Program (column tile of one member, row block): out[rows, tile] += scale * xa @ B[tile]^T, with
        ``xa`` given (``SPLITS`` = 1) or the sum of ``SPLITS`` fp32 partials, rounded to the activation dtype.
        With ``BASE_SLICES`` > 0 the tile's ``out`` is first made from the base GEMM's fp32 partials ``ws [S, M, N]``
        as ``fp4_gemm.reduce_splits`` makes it (``_splitk_reduce_kernel``'s arithmetic, in its order)."""
        t, pid_m = tl.program_id(0), tl.program_id(1)
        n0 = tl.load(tiles_ptr + 3 * t)
        n1 = tl.load(tiles_ptr + 3 * t + 1)
        j = tl.load(tiles_ptr + 3 * t + 2)
        r0 = tl.load(r_start_ptr + j)
        rank = tl.load(rank_ptr + j)
        scale = tl.load(scale_ptr + j)
        cols = n0 + tl.arange(0, BLOCK_N)
        ok_n = cols < n1
        rr = tl.arange(0, RP)
        b = tl.load(b_ptr + cols[:, None] * sb + rr[None, :], mask=ok_n[:, None], other=0.0)  # constant: before the wait
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ok_m = rows < M
        xa = member_xa(xa_ptr, rows, ok_m, r0, rank, M, R, sxa, SPLITS, BLOCK_M, RP).to(out_ptr.dtype.element_ty)
        delta = tl.dot(xa, tl.trans(b), input_precision=PRECISION)
        ptrs = out_ptr + rows[:, None] * so + cols[None, :]
        ok = ok_m[:, None] & ok_n[None, :]
        if BASE_SLICES > 0:  # reduce_splits' sum and epilogue, for this tile
            acc = summed_slices(ws_ptr, rows[:, None] * N + cols[None, :], ok, M * N, BASE_SLICES)
            o = finish(acc, gs_ptr, bias_ptr, cols[None, :], ok_n[None, :], HAS_BIAS, INTERPRETED)
        else:
            o = tl.load(ptrs, mask=ok, other=0.0)
        tl.store(ptrs, (o.to(tl.float32) + scale * delta).to(out_ptr.dtype.element_ty), mask=ok)
