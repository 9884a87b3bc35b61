"""Triton kernels for the DFlash verify step (shipped as ``sglang_dflash.kernels``).

Each kernel module has a pure-torch ``*_ref`` (the specification and the CPU path), one
``@triton.jit`` kernel launched once per batch (one program per request), and a launcher that
validates its inputs once and dispatches with :func:`use_triton`.
"""

import os

import torch


def use_triton(device: torch.device) -> bool:
    """Launch the Triton kernel for tensors on ``device``: always on CUDA; on CPU only when
    ``TRITON_INTERPRET=1`` (the Triton interpreter). Otherwise the launcher runs the torch ref."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# Imported after use_triton, which the kernel modules import from this package.
from .accept import accept_ref, accept_tokens  # noqa: E402
from .block_builder import build_block, build_block_ref  # noqa: E402
from .draft_layers import norm_rope, norm_rope_ref, rms_norm, rms_norm_ref, silu_mul, silu_mul_ref  # noqa: E402

__all__ = ["use_triton", "build_block", "build_block_ref", "accept_tokens", "accept_ref", "rms_norm", "rms_norm_ref",
           "norm_rope", "norm_rope_ref", "silu_mul", "silu_mul_ref"]
