"""Which of torch's fused attention kernels serve a device: read once per trace (constants to
torch.compile), shared by the windowed simulate attention and the chunk attention."""

from __future__ import annotations

import torch


@torch.compiler.assume_constant_result
def flash_serves(device: torch.device) -> bool:
    """FlashAttention-2 (``aten._flash_attention_forward``) runs on ``device``: CUDA, sm80 or newer,
    built into this torch and not switched off (``torch.backends.cuda.enable_flash_sdp(False)``).
    Read once per trace (a constant to torch.compile)."""
    return (
        device.type == "cuda"
        and torch.backends.cuda.is_flash_attention_available()
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


@torch.compiler.assume_constant_result
def cudnn_serves(device: torch.device) -> bool:
    """cuDNN attention runs on ``device`` and is SDPA's first choice there: CUDA, sm90 or newer,
    cuDNN present and not switched off (``torch.backends.cuda.enable_cudnn_sdp(False)``)."""
    return (
        device.type == "cuda"
        and torch.backends.cudnn.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )
