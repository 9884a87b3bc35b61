"""SGLang plugin entry point (group `sglang.srt.plugins`)."""

import sys

ERROR_PREFIX = "sglang-dflash:"


def register() -> None:
    """Called by SGLang in the launcher and in every scheduler process: the CPU set-up where SGLang serves on the
    CPU (`cpu_platform`, and `cpu_linear_attn` for hybrid models; for every server), then the DFLASH hooks."""
    from sglang_dflash.adapter import cpu_linear_attn, cpu_platform

    if not getattr(sys.excepthook, "one_line_errors", False):
        sys.excepthook = one_line_errors(sys.excepthook)
    on_cpu = cpu_platform.setup()
    if on_cpu:
        cpu_linear_attn.register_ops()
    from sglang_dflash.adapter.hooks import install  # after the CPU set-up: it imports SGLang's workers (`compat`)
    if install() and on_cpu:
        cpu_platform.register_hooks()
        cpu_linear_attn.register_hooks()


def one_line_errors(excepthook):
    """``excepthook`` that prints the plugin's refusals of bad input (a ``ValueError`` whose message starts with
    ``sglang-dflash:``, naming the problem and the fix) as that one line, without the traceback. They end the
    launcher when it parses the server arguments; the Python API raises them as usual."""

    def hook(exc_type, exc, tb):
        if isinstance(exc, ValueError) and str(exc).startswith(ERROR_PREFIX):
            print(exc, file=sys.stderr, flush=True)
            return
        excepthook(exc_type, exc, tb)

    hook.one_line_errors = True
    return hook
