"""NVFP4Linear: a frozen 4-bit Linear layer that holds only the packed NVFP4 tensors.

How it works
------------
``nn.Linear`` holds a bf16 ``weight [N, K]`` (2 bytes per weight). ``NVFP4Linear`` holds the
three compressed-tensors buffers instead (see ``qerl_lib.quant.nvfp4`` for the format):

``weight_packed``        uint8 ``[N, K/2]``           two E2M1 codes per byte
``weight_scale``         float8_e4m3fn ``[N, K/16]``  one block scale per 16 weights
``weight_global_scale``  float32 ``[1]``              the per-tensor encode factor

(+ an optional ``bias`` in the model dtype), i.e. 4.5 bits per weight, 28% of bf16. The
names are exactly the checkpoint suffixes, so ``model.load_state_dict(shard, assign=True)``
drops a compressed-tensors shard straight into the module (the "two-phase" pattern:
pack offline, swap ``nn.Linear`` for a module with packed-shape buffers, assign-load).

Forward, chosen per layer by the ``impl`` argument (not a global switch):

* ``"reference"``: ``F.linear(x, dequantize(W), bias)``. ``dequantize`` is bit-exact with
  compressed-tensors, so this layer computes exactly what transformers computes on a
  checkpoint loaded with ``CompressedTensorsConfig(dequantize=True)``. On CUDA the dense weight
  is a temporary that lives for one matmul; on CPU it is cached (next section).
* ``"kernel"``: ``qerl_lib.kernels.fp4_gemm.fp4_linear`` on a zero-copy ``PreparedFP4Weight`` cached
  by the layer (the Triton FP4 x BF16 GEMM on CUDA; on CPU that module's Marlin-style oracle
  ``nvfp4.reference_matmul``). It applies ``1/gs`` to the fp32 accumulator like Marlin, so it
  differs from ``"reference"`` in the last bits. It needs bf16 activations.
* ``"auto"`` (default): ``"kernel"`` for CUDA inputs, ``"reference"`` otherwise.

On the kernel path the layer's ``small_m_backend`` and ``mma_rule`` (both None by default: the
``QERL_FP4_SMALL_M`` environment variable and the launch rule ``pick_mma_config``) choose the
kernel of the decode step (M <= 8); ``set_small_m_kernel(model, ...)`` sets them on every layer.

The CPU weight cache
--------------------
Dequantizing is elementwise work over every weight, so redoing it for every matmul makes a CPU
decode step (a few tokens, one pass over all weights) several times slower than the matmul
itself: the layer would be paying to unpack the model at every generated token. On CPU the
reference path therefore keeps the dense weight it dequantized (in the activation dtype) and reuses
it while the format buffers are unchanged. It is the same tensor the uncached path would build,
so outputs and gradients are bit-identical. The cache:

* costs ``2 bytes x N x K`` per layer in bf16, ``4 bytes x N x K`` in fp32, on top of the
  packed 0.56 bytes: for SmolLM2-135M's 106M quantized weights that is 212 MB (bf16) or
  425 MB (fp32) of RAM. Where that matters more than speed (a 7B model on a CPU), turn it off:
  ``set_cpu_cache(model, False)`` for a model, ``NVFP4Linear.cpu_cache = False`` for the process;
* is never used on CUDA (the kernel path reads the packed bytes in place, which is the point of
  NVFP4 there; ``impl="reference"`` on CUDA keeps the temporary) nor on the CPU kernel oracle;
* is not a buffer: ``state_dict`` and checkpoints hold the three format tensors only, and
  pickling or ``copy.deepcopy`` drops it;
* is dropped by ``set_nvfp4_weight``, ``load_state_dict`` and any ``.to()``/``.float()``/device
  move, and is rebuilt when a format buffer is replaced (checked by identity, not by address) or
  written in place (the tensor's version counter; views share it). Writes through ``.data`` bypass
  version counters: call ``layer.clear_cache()`` after those.

Training through a frozen 4-bit layer
-------------------------------------
LoRA needs ``dL/dx`` of every base layer (to reach the adapters of earlier layers) but never
``dL/dW``. A plain ``F.linear(x, dequantize(W))`` would make autograd keep each layer's
dequantized bf16 weight alive from forward to backward, i.e. a full bf16 copy of the model
during training. ``_FrozenNVFP4Matmul`` saves only the packed buffers (already resident) and
expands the weight again in backward for ``dx = dy @ W``, the QLoRA trick (bitsandbytes
``MatMul4Bit``); the expanded weight is a temporary of that one matmul. The buffers never require
grad, so no gradient can reach them. Per path:

* kernel path (bf16 ``dy``): ``kernels.fp4_gemm.fp4_grad_input`` on the layer's prepared weight.
  It uses the forward's arithmetic: exact products ``dy * fp4 * s``, an fp32 sum and ``1/gs``
  applied once before a single bf16 rounding (on CUDA a Triton dequantization to a temporary bf16
  ``fp4 * s * 2^-8`` and one cuBLAS matmul with ``alpha = 2^8/gs``; on CPU the oracle
  ``nvfp4.reference_grad_input``). Any other ``dy`` dtype takes the reference path's backward.
* reference path: ``dy @ dequantize(W)`` in ``dy``'s dtype (the bf16-rounded weights, as the
  forward used them). On CPU the backward reuses the cached dense weight of the forward instead,
  which is resident anyway.

Under gradient checkpointing each weight is expanded three times a step at training sizes: in the
forward, in its recompute inside the backward pass, and for ``dy @ W`` right after. The recompute
therefore hands its temporary (the exact ``fp4 * s * 2^-8`` the backward would build) to the layer's
backward through a per-layer stash, which the backward empties: two expansions instead of three, and at
most the recomputed decoder layer's weights in bf16 at once (~0.5 GB at 7B, ~1 GB at 32B) on top of the
backward's memory. Only a forward that runs inside a backward pass (a recompute) and whose input needs a
gradient (so that its backward follows) fills the stash, so without checkpointing nothing is kept from
forward to backward, and the values are the same either way. ``QERL_FP4_RECOMPUTE_REUSE=0`` turns it off (dev/LOG.md 91).

Playing well with transformers and peft
---------------------------------------
* ``weight`` is a read-only property that returns the dequantized bf16 weight, computed on
  demand and never stored: code that only looks at ``layer.weight.dtype``/``.device``/
  ``.shape`` (peft does, when wrapping a layer) gets correct answers, and code that reads
  values gets the true values. A weak reference remembers the last result while someone
  still holds it, so peft's repeated ``hasattr(layer, "weight")`` costs one dequantization,
  not nine. Assigning ``layer.weight = ...`` raises: the packed weight cannot absorb it.
* ``model.to(dtype)`` / ``.half()`` cast only the bias and ``compute_dtype``; the format
  buffers keep uint8 / float8_e4m3fn / float32 (a bf16 global scale would change the
  arithmetic, nvfp4 docstring), while device moves apply to everything.
* ``_load_from_state_dict`` checks the three format tensors' dtype and shape and raises
  naming the full key, so a wrong shard can never be copied in with a silent cast.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from qerl_lib.quant import nvfp4

IMPLS = ("auto", "reference", "kernel")
FORMAT_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")


def _check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def resolve_impl(impl: str, device: torch.device) -> str:
    """``"auto"`` -> ``"kernel"`` on CUDA, ``"reference"`` elsewhere; other values pass through."""
    _check_impl(impl)
    if impl == "auto":
        return "kernel" if device.type == "cuda" else "reference"
    return impl


RECOMPUTE_REUSE_ENV = "QERL_FP4_RECOMPUTE_REUSE"


class RecomputeStash:
    """One layer's expanded weight from a checkpointed recompute, until that layer's backward takes it."""

    __slots__ = ("held",)

    def __init__(self):
        self.held = None  # (the PreparedFP4Weight it expands, bf16 fp4 * s * 2^-8) or None

    def take(self, prepared):
        held, self.held = self.held, None
        return held[1] if held is not None and held[0] is prepared else None


def in_backward_pass() -> bool:
    """Whether autograd's backward is running here: a forward now is a checkpointed layer's recompute."""
    return torch._C._current_graph_task_id() != -1


class _FrozenNVFP4Matmul(torch.autograd.Function):
    """``y = x @ W.T + b`` with W stored in NVFP4; gradient for ``x`` only (W and b are frozen)."""

    @staticmethod
    def forward(ctx, x, packed, scale, global_scale, bias, prepared, small_m_backend, mma_rule, dense=None,
                stash=None):
        # `dense`: the CPU cache's dequantized weight in x.dtype (NVFP4Linear._cached_dense), or None.
        # Resident either way (the buffers in the module, `dense` in the cache): saving them is free.
        ctx.save_for_backward(packed, scale, global_scale, dense)
        ctx.prepared = prepared  # the kernel path's zero-copy views of those buffers, or None
        ctx.stash = stash  # the layer's RecomputeStash (module docstring), or None
        if prepared is not None:  # the kernel path (kernels.fp4_gemm)
            from qerl_lib.kernels import fp4_gemm

            expanded = None
            # only where this node has a backward to take it (x needs a gradient): nothing is left behind
            if stash is not None and ctx.needs_input_grad[0] and in_backward_pass() \
                    and os.environ.get(RECOMPUTE_REUSE_ENV, "1") != "0" \
                    and fp4_gemm.takes_dense(x.numel() // x.shape[-1], prepared, x, small_m_backend):
                expanded = fp4_gemm.dequantize_exact(prepared, unscale=False)
                stash.held = (prepared, expanded)  # for this layer's backward, which runs next
            return fp4_gemm.fp4_linear(x, prepared, bias, small_m_backend=small_m_backend, mma_rule=mma_rule,
                                       dense=expanded)
        weight = dense if dense is not None else \
            nvfp4.dequantize(nvfp4.NVFP4Weight(packed, scale, global_scale), dtype=x.dtype)  # temporary
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        packed, scale, global_scale, dense = ctx.saved_tensors
        expanded = ctx.stash.take(ctx.prepared) if ctx.stash is not None else None  # emptied, used or not
        grad_x = None
        if ctx.needs_input_grad[0]:
            if ctx.prepared is not None and grad_out.dtype == torch.bfloat16:
                from qerl_lib.kernels.fp4_gemm import fp4_grad_input

                grad_x = fp4_grad_input(grad_out, ctx.prepared, dense=expanded)  # fp32 sum, 1/gs once, one rounding
            else:
                if dense is not None and dense.dtype == grad_out.dtype:
                    weight = dense  # the forward's weight, from the CPU cache: the same values as dequantizing again
                else:  # dequantize again instead of keeping a bf16 copy from forward (QLoRA's trick)
                    weight = nvfp4.dequantize(nvfp4.NVFP4Weight(packed, scale, global_scale), dtype=grad_out.dtype)
                grad_x = grad_out @ weight
        return grad_x, None, None, None, None, None, None, None, None, None


class NVFP4Linear(nn.Module):
    """A frozen Linear layer stored as NVFP4 (compressed-tensors layout); see the module docstring.

    Args:
        in_features: K, must be a multiple of 16 (the NVFP4 block size).
        out_features: N.
        bias: whether the layer has a (frozen) bias buffer.
        impl: ``"auto"`` | ``"reference"`` | ``"kernel"`` (forward path for this layer).
        compute_dtype: dtype of ``weight``/``dequantize()`` and of the bias (bf16 normally).
        device: where the (uninitialised) buffers are allocated; ``"meta"`` for a skeleton.
        name: the layer's name in its model, used in error messages.

    ``cpu_cache`` (class attribute, True): keep the dequantized weight between CPU forwards (module
    docstring). Set it on one layer, through ``set_cpu_cache(model, ...)``, or on the class for the process.
    """

    cpu_cache: bool = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False, impl: str = "auto",
                 compute_dtype: torch.dtype = torch.bfloat16, device=None, name: str = "NVFP4Linear"):
        super().__init__()
        if in_features % nvfp4.GROUP_SIZE != 0:
            raise ValueError(
                f"{name}: in_features = {in_features} must be a multiple of {nvfp4.GROUP_SIZE} (NVFP4 block size); "
                "leave this layer unquantized (add it to ignore)"
            )
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.impl = _check_impl(impl)
        self.compute_dtype = compute_dtype
        self.layer_name = name
        self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // nvfp4.GROUP_SIZE,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=compute_dtype, device=device) if bias else None)
        self._weight_ref = None  # weakref to the last dequantized weight (see `weight`)
        self._weight_key = None
        self._prepared = None  # kernels.fp4_gemm.PreparedFP4Weight (zero-copy views + host-side 1/gs), cached
        self._prepared_key = None
        # the CPU weight cache (module docstring): dense weight, weak refs to its source buffers, their versions
        self._dense = None
        self._dense_sources = None
        self._dense_key = None
        # the decode-step kernel on the kernel path (None: QERL_FP4_SMALL_M, and pick_mma_config)
        self.small_m_backend: str | None = None
        self.mma_rule = None  # (m, n, k) -> kernels.mma.MmaConfig
        self._recompute_stash = RecomputeStash()  # a checkpointed recompute's expanded weight (module docstring)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_linear(cls, linear: nn.Linear, global_scale: torch.Tensor | None = None, impl: str = "auto",
                    name: str = "linear") -> NVFP4Linear:
        """Quantize an ``nn.Linear`` (bit-exact with llm-compressor). Pass the fused group's
        ``nvfp4.global_scale(q, k, v)`` as ``global_scale`` to share it, as llm-compressor does."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name}: from_linear expects nn.Linear, got {type(linear).__name__}")
        weight = linear.weight.detach()
        q = nvfp4.quantize(weight, global_scale=global_scale, name=name)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, impl=impl,
                    compute_dtype=weight.dtype, device="meta", name=name)
        layer.set_nvfp4_weight(q)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().clone()
        return layer

    def set_nvfp4_weight(self, q: nvfp4.NVFP4Weight) -> None:
        """Replace the three format buffers (validated: dtypes, shapes, devices)."""
        q.validate(self.layer_name)
        if q.shape != (self.out_features, self.in_features):
            raise ValueError(f"{self.layer_name}: NVFP4 weight has shape {list(q.shape)}, "
                             f"the layer is [{self.out_features}, {self.in_features}]")
        self.weight_packed, self.weight_scale, self.weight_global_scale = (
            q.weight_packed, q.weight_scale, q.weight_global_scale)
        self._forget_derived()

    def _forget_derived(self) -> None:
        self._weight_ref = self._weight_key = None
        self._prepared = self._prepared_key = None
        self._dense = self._dense_sources = self._dense_key = None
        self._recompute_stash = RecomputeStash()

    def clear_cache(self) -> None:
        """Drop everything derived from the format buffers (the CPU weight cache, the kernel view, the
        last ``weight``). Needed only after writing into a buffer through ``.data``, which no version
        counter sees; replacing a buffer, ``load_state_dict`` and ``.to()`` are noticed on their own."""
        self._forget_derived()

    def prepare_kernel(self):
        """The kernel's view of the buffers (``kernels.fp4_gemm.PreparedFP4Weight``), built once and
        cached (it reads ``1/gs`` to the host, one sync, so do this before capturing CUDA graphs:
        ``prepare_kernels(model)``). Zero-copy: the kernel reads ``weight_packed``/``weight_scale``
        in place, so no second copy of the weight exists."""
        from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights

        key = (self.weight_packed.data_ptr(), self.weight_scale.data_ptr(), self.weight_global_scale.data_ptr(),
               self.weight_global_scale._version, self.weight_packed.device)
        if self._prepared is None or self._prepared_key != key:
            self._prepared = prepare_fp4_weights(self.weight_packed, self.weight_scale, self.weight_global_scale)
            self._prepared_key = key
        return self._prepared

    def _cached_dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The CPU cache: the dequantized weight in ``dtype``, rebuilt when a format buffer was replaced
        (identity through weak references, so a new tensor at a recycled address is not mistaken for
        the old one) or written in place (version counters), or when ``dtype`` changes."""
        buffers = (self.weight_packed, self.weight_scale, self.weight_global_scale)
        key = (tuple(t._version for t in buffers), dtype)
        sources = self._dense_sources
        if (self._dense is None or self._dense_key != key or sources is None
                or any(ref() is not t for ref, t in zip(sources, buffers))):
            self._dense = None  # free the stale copy before allocating the new one
            with torch.no_grad():
                self._dense = nvfp4.dequantize(nvfp4.NVFP4Weight(*buffers), dtype=dtype)
            self._dense_sources = tuple(weakref.ref(t) for t in buffers)
            self._dense_key = key
        return self._dense

    # ------------------------------------------------------------------ views of the weight
    @property
    def nvfp4_weight(self) -> nvfp4.NVFP4Weight:
        """The three buffers as an ``nvfp4.NVFP4Weight`` (no copy)."""
        return nvfp4.NVFP4Weight(self.weight_packed, self.weight_scale, self.weight_global_scale)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight ``[N, K]`` (bit-exact with compressed-tensors' decompress); a fresh tensor."""
        with torch.no_grad():
            return nvfp4.dequantize(self.nvfp4_weight, dtype=dtype or self.compute_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Read-only dequantized weight (compute_dtype), made on demand, never stored in the module."""
        key = tuple((t.data_ptr(), t._version, t.device) for t in
                    (self.weight_packed, self.weight_scale, self.weight_global_scale)) + (self.compute_dtype,)
        cached = self._weight_ref() if self._weight_ref is not None else None
        if cached is not None and self._weight_key == key:
            return cached
        weight = self.dequantize()
        self._weight_ref, self._weight_key = weakref.ref(weight), key
        return weight

    @weight.setter
    def weight(self, value) -> None:
        raise AttributeError(
            f"{self.layer_name}: NVFP4Linear.weight is read-only (it is dequantized from the packed buffers); "
            "quantize a new weight with nvfp4.quantize and call set_nvfp4_weight, or keep this layer as nn.Linear"
        )

    @property
    def resident_bytes(self) -> int:
        """Bytes of the format buffers (the bias is counted separately by callers)."""
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in FORMAT_BUFFERS)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``x @ W^T + bias``; ``add_bias=False`` leaves the bias out (a LoRA expand that adds it in its own pass
        over the output: `lora_forward.expand_add`)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.layer_name}: input last dim {x.shape[-1]} != in_features {self.in_features}")
        prepared = self.prepare_kernel() if resolve_impl(self.impl, x.device) == "kernel" else None
        dense = None
        if prepared is None and x.device.type == "cpu":  # the reference path on CPU: the weight cache
            if self.cpu_cache:
                dense = self._cached_dense(x.dtype)
            elif self._dense is not None:
                self._dense = self._dense_sources = self._dense_key = None  # turned off: free it
        return _FrozenNVFP4Matmul.apply(x, self.weight_packed, self.weight_scale, self.weight_global_scale,
                                        self.bias if add_bias else None, prepared, self.small_m_backend,
                                        self.mma_rule, dense,
                                        getattr(self, "_recompute_stash", None))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format=nvfp4 (4.5 bits/weight), impl={self.impl}")

    # ------------------------------------------------------------------ dtype/device moves, loading
    def _apply(self, fn, recurse=True):
        # `.to(dtype)`/`.half()` must not turn the fp8 scales or the fp32 global scale into another float
        # dtype (that would change the arithmetic); honour only the device part for the format buffers.
        originals = {name: getattr(self, name) for name in FORMAT_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in originals.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device=self.weight_packed.device))
        if probe.dtype.is_floating_point:
            self.compute_dtype = probe.dtype
        self._forget_derived()
        return self

    def __getstate__(self):
        state = super().__getstate__()
        # weak references do not pickle; the kernel view and the CPU weight cache are rebuilt on first use
        state.update(_weight_ref=None, _weight_key=None, _prepared=None, _prepared_key=None,
                     _dense=None, _dense_sources=None, _dense_key=None, _recompute_stash=RecomputeStash())
        return state

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        expected = {
            "weight_packed": (torch.uint8, (self.out_features, self.in_features // 2)),
            "weight_scale": (torch.float8_e4m3fn, (self.out_features, self.in_features // nvfp4.GROUP_SIZE)),
            "weight_global_scale": (torch.float32, (1,)),
        }
        for name, (dtype, shape) in expected.items():
            tensor = state_dict.get(prefix + name)
            if tensor is not None and (tensor.dtype != dtype or tuple(tensor.shape) != shape):
                raise ValueError(f"{prefix}{name}: expected {dtype} {list(shape)}, got {tensor.dtype} "
                                 f"{list(tensor.shape)} (not an NVFP4 compressed-tensors tensor for this layer)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._forget_derived()


def nvfp4_modules(model: nn.Module) -> dict[str, NVFP4Linear]:
    """All NVFP4Linear layers of a model by qualified name (peft-wrapped ones included)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}


def prepare_kernels(model: nn.Module) -> int:
    """Build every NVFP4Linear's kernel view now (one host sync each), e.g. before CUDA-graph capture."""
    layers = nvfp4_modules(model)
    for layer in layers.values():
        layer.prepare_kernel()
    return len(layers)


def set_impl(model: nn.Module, impl: str) -> int:
    """Set the forward path of every NVFP4Linear in ``model``; returns how many layers changed."""
    _check_impl(impl)
    layers = nvfp4_modules(model)
    for layer in layers.values():
        layer.impl = impl
    return len(layers)


def set_cpu_cache(model: nn.Module, enabled: bool) -> int:
    """Turn the CPU weight cache of every NVFP4Linear in ``model`` on or off (on by default; off frees
    the cached dense weights at once and makes CPU forwards dequantize per call, as on CUDA with
    ``impl="reference"``). Returns the number of layers set."""
    layers = nvfp4_modules(model)
    for layer in layers.values():
        layer.cpu_cache = bool(enabled)
        if not enabled:
            layer._dense = layer._dense_sources = layer._dense_key = None
    return len(layers)


def set_small_m_kernel(model: nn.Module, backend: str | None = None, mma_rule=None) -> int:
    """Choose the decode-step kernel (M <= 8) of every NVFP4Linear in ``model``: ``backend`` "auto",
    "mma" or "triton" (None: the ``QERL_FP4_SMALL_M`` environment variable, default "auto") and
    ``mma_rule``, a function ``(m, n, k) -> kernels.mma.MmaConfig`` for the mma.sync kernel's launch
    shape (None: the launch rule ``pick_mma_config``). Fused groups follow their first member. Takes
    effect at the next call (CUDA graphs captured earlier keep their kernels). Returns the number of
    layers set."""
    if backend is not None:
        from qerl_lib.kernels.fp4_gemm import resolve_small_m_backend

        resolve_small_m_backend(backend)  # validate now, not at the first forward
    layers = nvfp4_modules(model)
    for layer in layers.values():
        layer.small_m_backend, layer.mma_rule = backend, mma_rule
    return len(layers)
