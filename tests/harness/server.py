"""Run real ``python -m sglang.launch_server`` processes for tests, on CPU (default) or on a CUDA GPU.

CPU mode (``SGLANG_DFLASH_TEST_DEVICE`` unset or ``cpu``; what CI runs): the server runs stock SGLang with
``SGLANG_USE_CPU_ENGINE=1 --device cpu`` and the ``torch_native`` attention backend, set up for the CPU by the plugin
itself (``sglang_dflash.adapter.cpu_platform``; ``tests/test_cpu_serving.py`` starts the README's command without any
of this). ``sitecustomize/`` is put first on the server's PYTHONPATH for test-only switches (see its docstring), e.g.
the overlap schedule on CPU where a test asks for it (``SGLANG_DFLASH_TEST_CPU_OVERLAP=1``: SGLang's overlap
scheduler calls ``Tensor.record_stream``, which torch refuses for CPU streams, so that is a no-op for CPU tensors
there), and SGLang's scheduler and detokenizer forked from the launcher rather than spawned (a faster start-up).

GPU mode (``SGLANG_DFLASH_TEST_DEVICE=cuda``): the server gets ``CUDA_SERVER_ARGS`` (``--device cuda``, the
attention backend ``$SGLANG_DFLASH_TEST_GPU_BACKEND`` -- ``flashinfer`` by default, what the benchmarks serve,
or ``triton`` --, CUDA graphs for decode/verify ON, prefill CUDA graph off, a small KV pool so the suite's
servers share one GPU), no ``sitecustomize`` and no ``SGLANG_USE_CPU_ENGINE``. SGLang's CUDA kernels (RMSNorm
among them) run only fp16/bf16, so a test's ``--dtype float32`` is served as ``bfloat16`` (:func:`server_dtype`,
the one place that maps it): the identity comparisons (DFLASH vs no-spec, server vs transformers) then run in
bf16, where the 1-token decode and the multi-token verify forward round differently, and accept a parting only at
a near-tie of the reference (``sglang_dflash/compare.py``). ``SGLANG_DFLASH_TEST_BF16=1`` serves float32 as
bfloat16 on CPU as well, to run those bf16 comparisons without a GPU. ``SGLANG_DFLASH_TEST_GPU_DETERMINISTIC=1`` adds SGLang's
``--enable-deterministic-inference`` (batch-invariant matmuls and norms, fixed attention splits). Servers get
``STARTUP_TIMEOUT`` (420 s) to start (first start captures CUDA graphs and JIT-compiles kernels). Nothing here
needs the repo's ``.venv`` or the network; sglang and sglang-dflash (with its ``sglang.srt.plugins`` entry
point, i.e. installed, e.g. a wheel on PYTHONPATH) must be importable from the test process's PYTHONPATH,
which the servers inherit. Run from outside the checkout (so the installed package is imported)::

    SGLANG_DFLASH_TEST_DEVICE=cuda python3 -m pytest -q -ra --rootdir REPO REPO/tests/test_server_dflash.py \
        REPO/tests/test_harness.py

(no ``-x``: in bf16 a mismatch is an outcome to record, and ``-x`` would stop the run at the first one).
``SGLANG_DFLASH_TEST_DRAFTER=<dir>`` serves another drafter than the bundled one (``server_fixtures.py``).

Every server leads its own process group, which is killed when its ``with`` block ends, when the test process gets
SIGTERM, SIGINT or SIGHUP (a stopped or timed-out test run) or its parent dies (``tests/run.py``), and at interpreter
exit (:func:`kill_all_servers`). A server that does not answer ``/health_generate`` in time is killed and reported
with its last log lines.

    with launch_server(model_dir, ["--dtype", "float32"]) as server:
        out = server.generate([1, 2, 3], {"max_new_tokens": 8, "temperature": 0})
        out["output_ids"]
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import requests

SITECUSTOMIZE_DIR = Path(__file__).resolve().parent / "sitecustomize"

DEVICE_ENV_VAR = "SGLANG_DFLASH_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


def _env_choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...], what: str) -> str:
    """``environ[name]`` if it is one of ``choices``; the first choice when unset or empty; anything else raises."""
    value = environ.get(name, "") or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not a {what}; use one of {choices} (default {choices[0]!r})")
    return value


def device_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``$SGLANG_DFLASH_TEST_DEVICE``: ``cpu`` (default) or ``cuda``."""
    return _env_choice(environ, DEVICE_ENV_VAR, DEVICES, "test device")


# The device every server of this test run uses (the one switch; see the module docstring).
DEVICE = device_from_env()

# Flags every CPU server gets unless ``extra_args`` names the same option.
#   --attention-backend torch_native: the x86 default ("intel_amx") needs sgl_kernel's CPU
#       build; torch_native is plain SDPA. It also turns CUDA graphs off.
#   --max-total-tokens: on CPU the KV pool would otherwise be sized from host RAM.
#   --sleep-on-idle: the scheduler blocks instead of spinning a core between requests.
#   --disable-radix-cache is NOT set: prefix reuse is part of what tests exercise.
CPU_SERVER_ARGS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--max-total-tokens": "8192",
    "--sleep-on-idle": None,
}

GPU_BACKEND_ENV_VAR = "SGLANG_DFLASH_TEST_GPU_BACKEND"
GPU_BACKENDS = ("flashinfer", "triton")
GPU_DETERMINISTIC_ENV_VAR = "SGLANG_DFLASH_TEST_GPU_DETERMINISTIC"
BF16_ENV_VAR = "SGLANG_DFLASH_TEST_BF16"


def gpu_backend_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """``$SGLANG_DFLASH_TEST_GPU_BACKEND``: ``flashinfer`` (default) or ``triton``."""
    return _env_choice(environ, GPU_BACKEND_ENV_VAR, GPU_BACKENDS, "test GPU backend")


# The attention backend of every GPU server of this test run, and whether they run deterministic inference.
GPU_BACKEND = gpu_backend_from_env()
GPU_DETERMINISTIC = _env_choice(os.environ, GPU_DETERMINISTIC_ENV_VAR, ("0", "1"), "switch") == "1"
# CPU servers (and the transformers references of the tests) serve float32 as bfloat16, as GPU mode does.
CPU_BF16 = _env_choice(os.environ, BF16_ENV_VAR, ("0", "1"), "switch") == "1"

# Flags every GPU server gets unless ``extra_args`` names the same option.
#   --attention-backend GPU_BACKEND (see the module docstring).
#   CUDA graphs stay ON for decode and DFLASH verify (no --disable-cuda-graph), up to batch 32;
#       --disable-prefill-cuda-graph: prefill runs eagerly (as in benchmarks/bench_dflash.py).
#   --mem-fraction-static 0.3 + --max-total-tokens: several servers of the suite run on one GPU at once, next to
#       other GPU work. SGLang 0.5.17 starts only if (1 - fraction) x total memory is still free after its weights
#       (0.12 failed next to a 35%-of-the-GPU job; 0.3 served the suite next to a 26 GB training job), and the token
#       cap, not the fraction, sizes each KV pool (SmolLM2-135M: 16384 tokens ~ 0.4 GB).
#   --sleep-on-idle: as on CPU.
CUDA_SERVER_ARGS: dict[str, str | None] = {
    "--device": "cuda",
    "--attention-backend": GPU_BACKEND,
    "--mem-fraction-static": "0.3",
    "--max-total-tokens": "16384",
    "--cuda-graph-max-bs": "32",
    "--disable-prefill-cuda-graph": None,
    "--sleep-on-idle": None,
}



def server_args(device: str, gpu_backend: str | None = None, deterministic: bool | None = None
                ) -> dict[str, str | None]:
    """Default flags of a server on ``device``; on ``cuda`` with ``gpu_backend`` (default ``GPU_BACKEND``) and
    SGLang's deterministic inference when ``deterministic`` (default ``GPU_DETERMINISTIC``)."""
    if device == "cpu":
        return CPU_SERVER_ARGS
    deterministic = GPU_DETERMINISTIC if deterministic is None else deterministic
    return {**CUDA_SERVER_ARGS, "--attention-backend": _gpu_backend(gpu_backend),
            **({"--enable-deterministic-inference": None} if deterministic else {})}

# The two crash-dump switches stop the server from sleeping 5 s + 60 s (py-spy / CUDA core dump) after a
# scheduler crash before it exits.
_COMMON_SERVER_ENV: dict[str, str] = {
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# SGLANG_USE_CPU_ENGINE selects the CPU platform.
CPU_SERVER_ENV: dict[str, str] = {"SGLANG_USE_CPU_ENGINE": "1", **_COMMON_SERVER_ENV}
CUDA_SERVER_ENV: dict[str, str] = dict(_COMMON_SERVER_ENV)

# --dtype values a GPU server serves differently: SGLang's CUDA RMSNorm and flashinfer have no float32 kernels.
CUDA_DTYPES: dict[str, str] = {"float32": "bfloat16", "float": "bfloat16"}

# Seconds a server gets to answer /health_generate (GPU: CUDA graph capture + JIT on first start).
STARTUP_TIMEOUTS: dict[str, float] = {"cpu": 300.0, "cuda": 420.0}
STARTUP_TIMEOUT = STARTUP_TIMEOUTS[DEVICE]

LOG_TAIL_LINES = 40


class ServerStartupError(RuntimeError):
    """The server process exited or timed out before ``/health_generate`` answered 200."""


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, below the ephemeral range (32768+) and not handed out before.

    ``bind(0)`` ports come from the ephemeral range, where a server starting next to ours (SGLang picks its
    internal ports there) can take the port between our check and the server's own bind (EADDRINUSE).
    """
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def _option_names(args: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def _given(value: str | None, default: str, choices: tuple[str, ...], what: str) -> str:
    """``value`` checked against ``choices``, ``default`` when None."""
    if value is None:
        return default
    if value not in choices:
        raise ValueError(f"{what} {value!r} is not one of {choices}")
    return value


def _device(device: str | None) -> str:
    return _given(device, DEVICE, DEVICES, "test device")


def _gpu_backend(gpu_backend: str | None) -> str:
    return _given(gpu_backend, GPU_BACKEND, GPU_BACKENDS, "GPU backend")


def server_dtype(dtype: str, device: str | None = None, gpu_backend: str | None = None) -> str:
    """The ``--dtype`` a server on ``device`` (default ``DEVICE``) runs when a test asks for ``dtype``.

    The only place a test's dtype is changed: on ``cuda`` float32 becomes bfloat16 (SGLang's CUDA kernels are
    fp16/bf16 only; every GPU backend alike); on ``cpu`` every dtype is kept, unless ``$SGLANG_DFLASH_TEST_BF16=1``
    asks for the GPU mode's bfloat16 there too (to run the bf16 comparisons without a GPU).
    """
    _gpu_backend(gpu_backend)
    return CUDA_DTYPES.get(dtype, dtype) if _device(device) == "cuda" or CPU_BF16 else dtype


def _map_dtype(args: list[str], device: str, gpu_backend: str | None) -> list[str]:
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a == "--dtype" and i + 1 < len(args):
            out += [a, server_dtype(args[i + 1], device, gpu_backend)]
            i += 2
            continue
        if a.startswith("--dtype="):
            a = "--dtype=" + server_dtype(a.split("=", 1)[1], device, gpu_backend)
        out.append(a)
        i += 1
    return out


def server_command(model_path: str | os.PathLike, port: int, extra_args: Sequence[str] = (),
                   device: str | None = None, gpu_backend: str | None = None,
                   deterministic: bool | None = None) -> list[str]:
    """argv of a server on ``device`` (default ``DEVICE``): that device's :func:`server_args` minus any option
    ``extra_args`` repeats, then ``extra_args`` (its ``--dtype`` through :func:`server_dtype`)."""
    device = _device(device)
    extra_args = _map_dtype([str(a) for a in extra_args], device, gpu_backend)
    overridden = _option_names(extra_args)
    for reserved in ("--model-path", "--port", "--host"):
        if reserved in overridden:
            raise ValueError(f"{reserved} is set by launch_server; pass model_path instead of {reserved}")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", "127.0.0.1", "--port", str(port)]
    for name, value in server_args(device, gpu_backend, deterministic).items():
        if name not in overridden:
            cmd += [name] if value is None else [name, value]
    return cmd + extra_args


def server_env(env: Mapping[str, str] | None = None, device: str | None = None) -> dict[str, str]:
    """Environment of a server on ``device`` (default ``DEVICE``).

    cpu: os.environ + ``CPU_SERVER_ENV`` + ``env``, with ``SITECUSTOMIZE_DIR`` first on PYTHONPATH.
    cuda: os.environ + ``CUDA_SERVER_ENV`` + ``env``, without ``SITECUSTOMIZE_DIR`` on PYTHONPATH and without an
    inherited ``SGLANG_USE_CPU_ENGINE`` (either would turn the server into a CPU one).
    """
    device = _device(device)
    base = CPU_SERVER_ENV if device == "cpu" else CUDA_SERVER_ENV
    out = {**os.environ, **base, **(env or {})}
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if device == "cpu":
        paths = [str(SITECUSTOMIZE_DIR)] + paths
    else:
        paths = [p for p in paths if Path(p).resolve() != SITECUSTOMIZE_DIR]
        if "SGLANG_USE_CPU_ENGINE" not in (env or {}):
            out.pop("SGLANG_USE_CPU_ENGINE", None)
    if paths:
        out["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        out.pop("PYTHONPATH", None)
    return out


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of the log at ``path`` (each cut at 2,000 characters: SGLang logs its server args on one
    line)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(line[:2000] for line in text.splitlines()[-n:])


# Server processes (each the leader of its own group) not yet killed, by pid. Reentrant: a signal handler runs
# kill_all_servers in the main thread, possibly while that thread holds the lock.
_LIVE: dict[int, subprocess.Popen] = {}
_LIVE_LOCK = threading.RLock()


def _kill_group(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """Kill the server's whole process group (it leads its own: ``start_new_session=True``).

    ``grace > 0`` first sends SIGTERM and waits up to ``grace`` s for SGLang's own shutdown
    (it drains requests and polls every 5 s, so a clean exit takes ~7 s); tests don't need it.
    """
    if grace > 0 and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with _LIVE_LOCK:
        _LIVE.pop(proc.pid, None)


def kill_all_servers() -> None:
    """Kill the process group of every server still running (signal handlers and interpreter exit)."""
    with _LIVE_LOCK:
        procs = list(_LIVE.values())
        _LIVE.clear()
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _kill_servers_then(previous):
    """Signal handler: kill every server, then do what ``previous`` (the handler it replaced) did."""

    def handler(signum, frame):
        kill_all_servers()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # SIG_DFL (or None): die of the signal, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return handler


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _install_cleanup() -> None:
    """Servers die with the test process: on SIGTERM / SIGINT / SIGHUP (a stopped or timed-out run) and at exit;
    on Linux the test process also gets SIGTERM when the process that started it dies (``tests/run.py`` runs pytest
    as a child: a SIGTERM to it reaches the servers this way). Signal handlers can only be set from the main thread,
    where this module is first imported."""
    atexit.register(kill_all_servers)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _kill_servers_then(signal.getsignal(sig)))
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_install_cleanup()


class Server:
    """Handle on a running server; every request raises on a non-200 answer."""

    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: Path):
        self.proc = proc
        self.base_url = base_url
        self.log_path = log_path

    def post(self, route: str, payload: dict, timeout: float = 300.0) -> dict:
        r = requests.post(f"{self.base_url}{route}", json=payload, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"POST {route} -> {r.status_code}: {r.text[:2000]}")
        return r.json()

    def get(self, route: str, timeout: float = 60.0) -> dict:
        r = requests.get(f"{self.base_url}{route}", timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"GET {route} -> {r.status_code}: {r.text[:2000]}")
        return r.json()

    def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: Mapping | None = None,
        return_logprob: bool = False,
        timeout: float = 300.0,
    ) -> dict:
        """POST /generate for one prompt (text, or token ids sent as ``input_ids``)."""
        payload: dict = {"sampling_params": dict(sampling_params or {}), "return_logprob": return_logprob}
        if isinstance(prompt, str):
            payload["text"] = prompt
        else:
            payload["input_ids"] = [int(t) for t in prompt]
        return self.post("/generate", payload, timeout=timeout)

    def get_server_info(self) -> dict:
        return self.get("/get_server_info")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def _log_path(log_path: str | os.PathLike | None) -> Path:
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return log_path


def start_process(cmd: Sequence[str], env: Mapping[str, str], log_path: Path,
                  cwd: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group, output to ``log_path``, killed with the test run."""
    with open(log_path, "wb") as log, _LIVE_LOCK:
        proc = subprocess.Popen(list(cmd), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
        _LIVE[proc.pid] = proc
    return proc


def _start(model_path, extra_args, env, log_path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_path = _log_path(log_path)
    # not the checkout: ``python -m`` puts the cwd first on sys.path, and the source tree's ``sglang_dflash``
    # (without ``sglang_dflash.kernels``, which lives in kernels/) would shadow the installed package that a
    # user's server imports
    proc = start_process(server_command(model_path, port, extra_args), server_env(env), log_path,
                         cwd=log_path.parent)
    return proc, f"http://127.0.0.1:{port}", log_path


def _wait_healthy(proc: subprocess.Popen, base_url: str, deadline: float) -> bool:
    """True once /health_generate answers 200; False if the process exits first or time runs out."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{base_url}/health_generate", timeout=30).status_code == 200:
                return True
        time.sleep(0.5)
    return False


@contextlib.contextmanager
def launch_server(
    model_path: str | os.PathLike,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    log_path: str | os.PathLike | None = None,
) -> Iterator[Server]:
    """Start a server on ``DEVICE`` on a free port, yield a ``Server`` once healthy, always kill its process group.

    Raises ``ServerStartupError`` (with the log tail) if the process exits or ``timeout`` s (default
    ``STARTUP_TIMEOUT``) pass before ``/health_generate`` answers 200.
    """
    proc, base_url, log_path = _start(model_path, extra_args, env, log_path)
    with serving(proc, base_url, log_path, timeout) as server:
        yield server


@contextlib.contextmanager
def serving(proc: subprocess.Popen, base_url: str, log_path: Path, timeout: float | None = None) -> Iterator[Server]:
    """Yield a ``Server`` for the server process ``proc`` (from :func:`start_process`) once ``base_url`` answers
    ``/health_generate``; always kill its process group.

    Raises ``ServerStartupError`` with the last ``LOG_TAIL_LINES`` lines of its log if it exits or ``timeout`` s
    (default ``STARTUP_TIMEOUT``) pass first.
    """
    timeout = STARTUP_TIMEOUT if timeout is None else timeout
    try:
        if not _wait_healthy(proc, base_url, time.monotonic() + timeout):
            rc = proc.poll()
            why = (f"exited with code {rc}" if rc is not None else
                   f"was not healthy after {timeout:.0f} s (killed)")
            raise ServerStartupError(f"sglang server {why}; log {log_path}, last {LOG_TAIL_LINES} lines:\n"
                                     f"{_tail(log_path)}")
        yield Server(proc, base_url, log_path)
    finally:
        _kill_group(proc)


def expect_startup_failure(
    model_path: str | os.PathLike,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    log_path: str | os.PathLike | None = None,
) -> str:
    """Start a server that must fail; return its full log once it exits non-zero before becoming healthy.

    Raises AssertionError if it becomes healthy, exits 0, or is still running after ``timeout`` s (default
    ``STARTUP_TIMEOUT``).
    """
    timeout = STARTUP_TIMEOUT if timeout is None else timeout
    proc, base_url, log_path = _start(model_path, extra_args, env, log_path)
    try:
        if _wait_healthy(proc, base_url, time.monotonic() + timeout):
            raise AssertionError(f"server became healthy but was expected to fail; log {log_path}")
        rc = proc.poll()
        if rc is None:
            raise AssertionError(
                f"server neither failed nor became healthy within {timeout:.0f} s; tail:\n{_tail(log_path)}"
            )
        if rc == 0:
            raise AssertionError(f"server exited 0 but was expected to fail; tail:\n{_tail(log_path)}")
        return log_path.read_text(errors="replace")
    finally:
        _kill_group(proc)
