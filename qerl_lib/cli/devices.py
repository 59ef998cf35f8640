"""`--device` for the commands that load a model themselves (`qerl generate`, `qerl eval`)."""

from __future__ import annotations

from qerl_lib.errors import UserError


def resolve_cli_device(text: str | None):
    """``None`` or ``"auto"``: cuda when available, else cpu. A CUDA device must be present, and ``cuda:N`` must
    name a visible GPU, which becomes the process's current device: the kit's Triton and NVRTC kernels launch on
    the current device's stream (dev/LOG.md section 114). Bad input is a one-line ``UserError`` naming the fix."""
    import torch

    auto = text in (None, "auto")
    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if auto else text)
    except RuntimeError:  # torch's "Expected one of cpu, cuda, ... device type at start of device string"
        raise UserError(f"--device {text}: not a device torch knows: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {text}: the kit runs on cpu or cuda: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {text} but CUDA is not available: use --device cpu")
    if device.type == "cuda" and device.index is not None:
        count = torch.cuda.device_count()
        if device.index >= count:
            raise UserError(f"--device {text}: this machine has {count} visible GPU(s): use cuda:0 to "
                            f"cuda:{count - 1} (or check CUDA_VISIBLE_DEVICES)")
        torch.cuda.set_device(device)
    return device
