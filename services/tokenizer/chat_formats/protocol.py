"""The contract between the tokenizer service and the per-model prompt renderers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class ChatRenderError(ValueError):
    """A request's messages, tools or template kwargs cannot be rendered.

    Always the client's fault (maps to HTTP 400 / gRPC INVALID_ARGUMENT). `field` names the
    offending part of the request, e.g. `messages[2].content`, so the message can point at it.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class ChatRenderer(Protocol):
    """Turns an OpenAI chat request into the prompt string the model was trained on.

    The prompt carries its own special tokens (BOS included): encode it with
    `add_special_tokens=False`. Rendering is CPU-bound; call it off the event loop.
    """

    name: str

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """Renders OpenAI-shaped messages and tools; raises `ChatRenderError` on bad input."""
        ...
