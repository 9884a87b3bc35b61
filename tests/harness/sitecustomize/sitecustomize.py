"""Test-only start-up hook that lets stock SGLang run on a machine without a GPU driver.

Put this directory on PYTHONPATH of an ``sglang.launch_server`` subprocess; Python imports
``sitecustomize`` automatically at start-up. Nothing else in the repo imports it.

Why: ``import sgl_kernel`` (pulled in by sglang's layers) loads its native ``common_ops``
extension, which links against ``libcuda.so.1`` and so fails without an NVIDIA driver
("Could not load any common_ops library"). Its loader's last resort is a plain
``import common_ops``; registering an empty module under that name turns the load into a
no-op. No ``sgl_kernel`` op is ever called with ``SGLANG_USE_CPU_ENGINE=1 --device cpu``
and the torch_native attention backend: every layer takes its ``forward_native`` path.
"""

import sys
import types

if "common_ops" not in sys.modules:
    _stub = types.ModuleType("common_ops")
    _stub.__file__ = __file__  # the loader logs the module's __file__
    sys.modules["common_ops"] = _stub
