"""SmolLM2 servers for the DFLASH end-to-end tests: a no-spec reference and a DFLASH server.

The drafter is ``$SGLANG_DFLASH_TEST_DRAFTER`` when set (a trained DFlash drafter directory for SmolLM2),
else the bundled one (``sglang_dflash.assets.bundled_drafter_path()``) when it is committed, otherwise a
random 1-layer drafter written by :func:`make_random_drafter`; :func:`drafter_for_tests` says which. Both
servers ask for float32 with the harness defaults plus ``--enable-cache-report`` (SGLang fills the OpenAI
``usage.prompt_tokens_details.cached_tokens`` only with that flag); they run float32 except in the harness's
GPU mode with the flashinfer backend, which serves bfloat16 (``harness.server.server_dtype``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.server import STARTUP_TIMEOUT, Server, free_port, launch_server

# Flags of every server in these tests (on top of the harness defaults of the device mode).
COMMON_ARGS = ("--dtype", "float32", "--enable-cache-report")
# One intra-op thread per server: several servers share 2 cores in these tests, and OpenMP threads
# spin-waiting on descheduled peers made each decode step ~20x slower than with one thread.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
RANDOM_DRAFTER_BLOCK_SIZE = 8


# A trained drafter directory to serve instead of the bundled one (any device mode).
DRAFTER_ENV_VAR = "SGLANG_DFLASH_TEST_DRAFTER"


def bundled_drafter() -> Path | None:
    """The trained SmolLM2 drafter: ``$SGLANG_DFLASH_TEST_DRAFTER`` when set (it must hold a config.json),
    else the committed one, or None while that is not in the tree."""
    override = os.environ.get(DRAFTER_ENV_VAR)
    if override:
        path = Path(override)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{DRAFTER_ENV_VAR}={override!r} has no config.json; point it at a DFlash "
                                    "drafter directory or unset it to use the bundled drafter")
        return path

    from sglang_dflash.assets import bundled_drafter_path

    try:
        return bundled_drafter_path()
    except FileNotFoundError:
        return None


def mask_token_id() -> int:
    """The bundled drafter's MASK id if it exists, else SmolLM2's unused ``<empty_output>`` (16)."""
    from sglang_dflash.assets import SMOLLM2_MASK_TOKEN_ID

    path = bundled_drafter()
    if path is None:
        return SMOLLM2_MASK_TOKEN_ID
    return int(json.loads((path / "config.json").read_text())["dflash_config"]["mask_token_id"])


def make_random_drafter(out_dir: str | Path, target_dir: str | Path, block_size: int = RANDOM_DRAFTER_BLOCK_SIZE,
                        seed: int = 0, **draft_fields) -> Path:
    """Write a random bf16 1-layer DFlash drafter shaped for the target at ``target_dir`` to ``out_dir``;
    ``draft_fields`` override the draft config's fields taken from the target (e.g. ``rope_scaling=None``)."""
    import torch
    from transformers import AutoConfig

    from sglang_dflash.config import DFlashDraftConfig
    from sglang_dflash.model import DFlashDraftModel, save_draft

    cfg = DFlashDraftConfig.from_target(AutoConfig.from_pretrained(target_dir), num_hidden_layers=1,
                                        mask_token_id=mask_token_id(), block_size=block_size,
                                        **draft_fields)
    torch.manual_seed(seed)
    save_draft(DFlashDraftModel(cfg).to(torch.bfloat16), out_dir)
    return Path(out_dir)


def drafter_for_tests(tmp_dir: str | Path, target_dir: str | Path) -> tuple[Path, bool]:
    """(drafter directory, is_bundled): the trained drafter (:func:`bundled_drafter`), else a random one written
    under ``tmp_dir``."""
    path = bundled_drafter()
    if path is not None:
        return path, True
    return make_random_drafter(Path(tmp_dir) / "random-drafter", target_dir), False


HUB_REPO_ID = "someone/dflash-draft"


def hub_cache(draft_dir: str | Path, root: str | Path) -> dict[str, str]:
    """Lay ``draft_dir`` out under ``root`` as huggingface_hub's cache holds repo :data:`HUB_REPO_ID` (a snapshot
    and ``refs/main``); returns the environment that serves it offline from there (``HF_HUB_CACHE``,
    ``HF_HUB_OFFLINE=1``)."""
    import shutil

    commit = "cd" * 20
    repo = Path(root) / ("models--" + HUB_REPO_ID.replace("/", "--"))
    shutil.copytree(draft_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return {"HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1"}


def broken_drafts(draft_dir: str | Path, target_dir: str | Path, root: str | Path) -> dict[str, tuple[str, list, str]]:
    """Broken variants of the drafter at ``draft_dir`` for the target at ``target_dir``, written under ``root``:
    name -> (draft directory, extra server args, the message sglang-dflash must refuse it with). SGLang's server-arg
    resolution refuses ``no-config``, ``mask-own`` and ``block-65`` (in the launcher); the worker refuses ``hidden``
    and ``mask-target``, checking the draft against the target's config (in the scheduler)."""
    import shutil

    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(target_dir)
    root = Path(root)

    def edited(name, edit):
        shutil.copytree(draft_dir, root / name)
        cfg = json.loads((root / name / "config.json").read_text())
        edit(cfg)
        (root / name / "config.json").write_text(json.dumps(cfg))
        return str(root / name)

    no_config = root / "no-config"
    shutil.copytree(draft_dir, no_config)
    (no_config / "config.json").unlink()
    hidden = edited("hidden", lambda cfg: cfg.update(hidden_size=t.hidden_size - 64))
    mask_own = edited("mask-own", lambda cfg: cfg["dflash_config"].update(mask_token_id=cfg["vocab_size"]))

    def mask_vs_target(cfg):  # a draft vocab larger than the target's: only the check against the target catches it
        cfg["vocab_size"] = t.vocab_size + 8
        cfg["dflash_config"]["mask_token_id"] = t.vocab_size

    mask_target = edited("mask-target", mask_vs_target)
    return {
        "no-config": (str(no_config), [], f"sglang-dflash: cannot use draft '{no_config}': no config.json at "
                                         f"'{no_config}/config.json'; not a DFlash checkpoint."),
        "mask-own": (mask_own, [], f"sglang-dflash: cannot use draft '{mask_own}': dflash_config.mask_token_id="
                                   f"{t.vocab_size} is >= vocab_size={t.vocab_size} (or negative)"),
        "block-65": (str(draft_dir), ["--speculative-dflash-block-size", "65"],
                     "sglang-dflash: block size 65 is out of range [2, 64]. Pass --speculative-dflash-block-size "
                     "within that range."),
        "hidden": (hidden, [], f"hidden size mismatch: draft hidden_size={t.hidden_size - 64}, target hidden_size="
                               f"{t.hidden_size}; use a draft trained for this target model."),
        "mask-target": (mask_target, [], f"dflash_config.mask_token_id={t.vocab_size} is >= the target vocab size "
                                         f"{t.vocab_size}; pick a mask token inside the target vocabulary"),
    }


def nccl_port_args(n: int) -> list[list[str]]:
    """``["--nccl-port", P]`` for ``n`` servers, ports from :func:`harness.server.free_port`.

    SGLang otherwise binds its torch.distributed store to a port it picked with ``bind(0)`` (in the
    ephemeral range) many seconds earlier; with several servers starting at once that port was taken
    in between (EADDRINUSE).
    """
    return [["--nccl-port", str(free_port())] for _ in range(n)]


# The tests compare DFLASH's verify steps with the reference engine's fixed-width steps: the verify width is pinned
# to the block size unless a test passes its own --speculative-adaptive-config.
FIXED_WIDTH = ["--speculative-adaptive-config", '{"adaptive": false}']


def dflash_args(draft_dir: str | Path, *extra: str) -> list[str]:
    pin = [] if "--speculative-adaptive-config" in extra else FIXED_WIDTH
    return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft_dir), *pin, *extra]


@contextlib.contextmanager
def launch_servers(specs: Mapping[str, tuple], timeout: float = max(600.0, STARTUP_TIMEOUT),
                   log_dir: str | Path | None = None) -> Iterator[dict[str, Server]]:
    """Start one server per ``name: (model_path, extra_args[, env])`` concurrently; yield ``{name: Server}``.

    ``timeout`` defaults to 600 s, never below the harness's ``STARTUP_TIMEOUT`` (GPU mode: 420 s).

    Each gets its own ``--nccl-port`` (:func:`nccl_port_args`). Every server is killed on exit,
    including the others when one fails to start.
    """
    with contextlib.ExitStack() as stack:
        cms = {name: launch_server(spec[0], [*spec[1], *port], env={**SERVER_ENV, **(spec[2] if len(spec) > 2 else {})},
                                   timeout=timeout, log_path=None if log_dir is None else Path(log_dir) / f"{name}.log")
               for (name, spec), port in zip(specs.items(), nccl_port_args(len(specs)))}
        with ThreadPoolExecutor(max_workers=len(cms)) as pool:
            futures = {name: pool.submit(cm.__enter__) for name, cm in cms.items()}
        servers, errors = {}, []
        for name, fut in futures.items():
            if fut.exception() is None:
                servers[name] = fut.result()
                stack.push(cms[name].__exit__)
            else:
                errors.append(fut.exception())
        if errors:
            raise errors[0]
        yield servers
