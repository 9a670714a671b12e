"""What a person sees on the console: third-party chatter only when asked for (-v)."""

from __future__ import annotations

import os


def quiet_hub_libraries() -> None:
    """Silence transformers' load reports and the hub's progress bars (shown again with -v)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import huggingface_hub.utils
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
