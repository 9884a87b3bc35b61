"""SGLang serving as the README says, on a machine without a GPU: the plugin's own CPU set-up
(``sglang_dflash.adapter.cpu_platform``), no test harness environment and no sitecustomize.

``test_readme_serving_command`` runs the README's Serving commands as written (``--port`` appended, so that it does
not take the default port of a shared machine; ``.venv/bin/python`` is this interpreter) and sends the README's
chat request. On a GPU host it runs the same commands there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from harness.server import SITECUSTOMIZE_DIR, STARTUP_TIMEOUT, free_port, serving, start_process

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
README_PYTHON = ".venv/bin/python"
README_PORT = "30000"  # SGLang's default, which the README's request addresses
PEAK_GB = 7  # the README's server: its scheduler spawned, not forked (conftest's _server_budget)


def _clean_env() -> dict[str, str]:
    """This process's environment without what the test harness adds: no SGLANG_* variable, no sitecustomize."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != SITECUSTOMIZE_DIR]
    env.pop("PYTHONPATH", None)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def test_cpu_setup_selects_sglang_cpu_engine_and_registers_sgl_kernel_ops():
    """In a process that imported SGLang's server args first (as the launcher does before plugins load), the set-up
    selects SGLang's CPU engine, makes sgl_kernel importable without a GPU driver, and registers the sgl_kernel CPU
    ops speculative decoding reaches, with the semantics of SGLang's Triton versions."""
    code = r"""
import os
import sglang.srt.server_args  # caches SGLang's device checks, as in the launcher
from sglang_dflash.adapter import cpu_platform
assert cpu_platform.setup()
assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
import sglang.srt.platforms as platforms
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.utils.common import get_device, is_cpu
assert is_cpu() and get_device() == "cpu", (is_cpu(), get_device())
assert platforms._current_platform is None or isinstance(platforms._current_platform, CpuSRTPlatform)

import torch
from sgl_kernel import assign_extend_cache_locs_cpu, assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu
k = torch.arange(40, dtype=torch.float32).view(10, 2, 2)
v = -k - 1
ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
want_k, want_v = k.clone(), v.clone()
tgt, src = torch.tensor([0, 1, 7]), torch.tensor([1, 0, 3])  # includes a swap: gather before scatter
want_k[tgt], want_v[tgt] = k[src].clone(), v[src].clone()
copy_all_layer_kv_cache_cpu(ptrs, torch.tensor([16, 16]), tgt, src)
assert torch.equal(k, want_k) and torch.equal(v, want_v), (k, v)

r2t = torch.zeros(3, 8, dtype=torch.int32)
idx, start, end = torch.tensor([2, 0]), torch.tensor([1, 0]), torch.tensor([3, 3])
assign_req_to_token_pool_cpu(idx, r2t, start, end, torch.tensor([7, 8, 9, 10, 11]), 8)
assert r2t.tolist() == [[9, 10, 11, 0, 0, 0, 0, 0], [0] * 8, [0, 7, 8, 0, 0, 0, 0, 0]], r2t
out = torch.zeros(5, dtype=torch.int64)
assign_extend_cache_locs_cpu(idx, r2t, start, end, out, 8)
assert out.tolist() == [7, 8, 9, 10, 11], out
print("ok")
"""
    env = _clean_env()
    from sglang_dflash.adapter.cpu_platform import accelerator_present

    if accelerator_present():  # a GPU host serves on CPU when asked
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def readme_serving() -> tuple[list[str], str, dict]:
    """The README's Serving section: the commands of its first bash block, and the route and JSON body of the
    request in its second."""
    section = README.read_text().split("\n## Serving\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = [ln for ln in blocks[0].replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#")]
    request = blocks[1].replace("\\\n", " ")
    route = re.search(rf"localhost:{README_PORT}(/\S+)", request).group(1)
    body = json.loads(re.search(r"-d '(.*?)'", request, re.S).group(1))
    return commands, route, body


@pytest.mark.server
def test_readme_serving_command(tmp_path):
    """The README's serving example answers its chat request with DFLASH's accept statistics in meta_info."""
    commands, route, body = readme_serving()
    assert commands[0].startswith(f'eval "$({README_PYTHON} -m sglang_dflash.assets --paths)"'), commands
    assert commands[-1].startswith(f"{README_PYTHON} -m sglang.launch_server "), commands
    assert "--speculative-algorithm DFLASH" in commands[-1] and body.get("return_meta_info") is True
    port = free_port()
    script = "set -e\n" + "\n".join(commands[:-1]) + f"\nexec {commands[-1]} --port {port}\n"
    if Path(sys.executable) != REPO / README_PYTHON:
        script = script.replace(README_PYTHON, shlex.quote(sys.executable))
    log = tmp_path / "readme-server.log"
    proc = start_process(["bash", "-c", script], _clean_env(), log, cwd=REPO)
    with serving(proc, f"http://127.0.0.1:{port}", log, timeout=max(600.0, STARTUP_TIMEOUT)) as server:
        r = requests.post(f"{server.base_url}{route}", json=body, timeout=600)
        assert r.status_code == 200, r.text[:2000]
        choice = r.json()["choices"][0]
        text = server.log_text()
    assert choice["message"]["content"].strip()
    meta = choice["meta_info"]
    n, steps, hist = meta["completion_tokens"], meta["spec_verify_ct"], meta["spec_accept_histogram"]
    assert 1 <= steps < n <= body["max_tokens"], meta  # the bundled drafter gets drafts accepted
    assert sum(hist) == steps and sum(i * h for i, h in enumerate(hist)) == meta["spec_accepted_drafts"], meta
    assert meta["spec_proposed_drafts"] == 15 * steps, meta  # block 16: 15 drafts per verify step
    assert n <= 1 + meta["spec_accepted_drafts"] + steps, meta  # first token + accepted drafts + a bonus per step
    assert meta["spec_accept_length"] == pytest.approx(n / steps), meta
    assert "DFLASH served by sglang-dflash" in text
    from sglang_dflash.adapter.cpu_platform import accelerator_present

    if not accelerator_present():  # the plugin's CPU set-up, logged
        assert "sglang-dflash: CPU attention backend torch_native" in text
        assert "sglang-dflash: CPU KV pool of" in text
