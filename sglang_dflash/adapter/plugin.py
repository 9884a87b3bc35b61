"""SGLang plugin entry point (group `sglang.srt.plugins`)."""


def register() -> None:
    """Called by SGLang in the launcher and in every scheduler process."""
    from sglang_dflash.adapter.hooks import install

    install()
