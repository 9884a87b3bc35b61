"""Stand-in for sgl_kernel's native ``common_ops`` on a host without an NVIDIA driver (see ``cpu_platform``).

sgl_kernel's loader imports this only after its native library failed to load. It defines no op: on CPU, SGLang's
layers take their native torch paths, and the few ``torch.ops.sgl_kernel`` CPU ops they reach are registered by
``sglang_dflash.adapter.cpu_platform``.
"""
