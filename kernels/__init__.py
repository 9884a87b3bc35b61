"""Triton kernels for the DFlash verify step (shipped as ``sglang_dflash.kernels``).

Each kernel module has a pure-torch ``*_ref`` (the specification and the CPU path), one
``@triton.jit`` kernel launched once per batch (one program per request), and a launcher that
validates its inputs once and dispatches with :func:`use_triton`.

In a source checkout this folder is also importable as the top-level ``kernels`` (Python started in the
repository root), a name that belongs to Hugging Face's ``kernels`` package, which transformers imports when
it is installed. Imported under that name, this module puts the installed package in its place (or, when
there is none, raises ImportError naming ``sglang_dflash.kernels``) and imports nothing of its own.
"""

import os
import sys


def _installed_package_instead(name: str):
    """Import the ``name`` package found on sys.path without this checkout's root, in place of this folder."""
    import importlib.util
    from importlib.machinery import PathFinder

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = PathFinder.find_spec(name, [p for p in sys.path if os.path.abspath(p or os.curdir) != root])
    if spec is None:
        raise ImportError(f"{os.path.dirname(__file__)} is sglang-dflash's kernels folder: import it as "
                          "sglang_dflash.kernels (no other top-level `kernels` package is installed)", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


if __name__ != "sglang_dflash.kernels":
    _installed_package_instead(__name__)
else:
    import torch

    def use_triton(device: torch.device) -> bool:
        """Launch the Triton kernel for tensors on ``device``: always on CUDA; on CPU only when
        ``TRITON_INTERPRET=1`` (the Triton interpreter). Otherwise the launcher runs the torch ref."""
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    # Imported after use_triton, which the kernel modules import from this package.
    from .accept import accept_ref, accept_tokens  # noqa: E402
    from .block_builder import build_block, build_block_ref  # noqa: E402
    from .draft_layers import (norm_rope, norm_rope_ref, rms_norm, rms_norm_ref, silu_mul,  # noqa: E402
                               silu_mul_ref)

    __all__ = ["use_triton", "build_block", "build_block_ref", "accept_tokens", "accept_ref", "rms_norm",
               "rms_norm_ref", "norm_rope", "norm_rope_ref", "silu_mul", "silu_mul_ref"]
