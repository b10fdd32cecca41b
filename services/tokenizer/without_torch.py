"""The tokenizer service runs transformers' tokenizers without importing torch.

transformers imports torch whenever it is installed, though tokenizers, configs and chat
templates use none of it. In the service, torch was about two thirds of the start's
(7 of 11 s on two cores) and 340 MB of its memory, paid again by every tokenizer a mesh starts.
"""

from __future__ import annotations

import logging
import sys

# transformers logs this at import when it finds no torch; here that is the intent.
_NO_TORCH_NOTICE = "PyTorch was not found"


def hide_torch_from_transformers() -> None:
    """Before transformers' first import: a None in `sys.modules` makes `import torch` fail and
    `importlib.util.find_spec("torch")`, transformers' availability check, return None. A
    checkpoint's own tokenizer code may need torch, so callers skip this for
    `--trust-remote-code`."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    logging.getLogger("transformers").addFilter(
        lambda record: not record.getMessage().startswith(_NO_TORCH_NOTICE))
