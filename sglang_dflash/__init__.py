"""sglang-dflash: DFlash block-diffusion speculative decoding for SGLang.

Core modules (config, model, verify, hf, train, eval) import only torch and
transformers; `sglang_dflash.adapter` is the only package that imports sglang.
"""

__version__ = "0.1.0"
