"""What the tokenizer client raises besides gRPC's own errors."""

from __future__ import annotations


class TokenizerTimeoutError(TimeoutError):
    """The tokenizer service did not answer a call, or a detokenize step, within its deadline."""

    def __init__(self, timeout_s: float | None) -> None:
        super().__init__(f"the tokenizer service did not answer in {timeout_s:g} s"
                         if timeout_s is not None else "the tokenizer service did not answer")
