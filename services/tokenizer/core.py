"""Tokenization with no transport: loading, chat rendering, encode/decode, streaming decode."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.tokenizer.chat_formats import ChatRenderer, ChatRenderError, chat_renderer_for
from services.tokenizer.chat_formats.selection import read_model_config
from services.tokenizer.client import MAX_CHARACTER_TOKENS, REPLACEMENT_CHARACTER

# About a millisecond of decoding. Longer lists go to `decode_batch`, which lets go of the GIL
# while it works (`decode` holds it), so that a worker thread decoding them leaves the event
# loop running; shorter ones decode faster one by one than spread over its threads
# (8 tokens: 0.11 ms against 0.46 ms).
LONG_DECODE_NUM_TOKENS = 1024
# How `DecodeStream.step`'s error begins when new text no longer starts with the text it sent.
INVALID_PREFIX_ERROR = "Invalid prefix encountered"


class UnknownTokenIdError(ValueError):
    """A request's token id lies outside the model's vocabulary: the client's fault."""

    def __init__(self, field: str, token_id: int, num_token_ids: int) -> None:
        super().__init__(f"{field}: token id {token_id} lies outside the vocabulary "
                         f"(the model's token ids are 0 to {num_token_ids - 1})")


class TokenizerCore:
    """One model's tokenizer and chat format."""

    def __init__(self, model_path: str, *, trust_remote_code: bool = False) -> None:
        self.model_path = model_path
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=trust_remote_code)
        if not self.hf.is_fast:
            raise ValueError(f"{model_path}: only fast (tokenizers-backed) tokenizers are supported")
        self.fast: Tokenizer = self.hf.backend_tokenizer
        # Whether transformers' `decode` (vLLM's for /detokenize, token prompts echoed and
        # logprob token texts) cleans up spaces before punctuation: where the config asks, but
        # not for a BPE model, where it would corrupt the text, unless the config insists.
        self.cleans_up_tokenization_spaces = bool(self.hf.clean_up_tokenization_spaces) and (
            type(self.fast.model).__name__ != "BPE"
            or bool(self.hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output))
        self.renderer: ChatRenderer = chat_renderer_for(model_path, self.hf)
        self.eos_token_ids = _eos_token_ids(model_path, self.hf)
        # The ids the engine takes and may generate: a model's embedding table is often padded
        # past the tokenizer's tokens (Qwen: 151936 rows for 151665 tokens), and those ids
        # decode to "" as vLLM shows them. Past it an id is the caller's mistake.
        self.num_token_ids = max(self.vocab_size, _model_vocab_size(model_path))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def check_token_ids(self, field: str, token_ids: Sequence[int]) -> None:
        """Raises `UnknownTokenIdError` naming `field` when an id lies past the vocabulary: the
        tokenizers library decodes such an id to "" without a word."""
        if token_ids and (largest := max(token_ids)) >= self.num_token_ids:
            raise UnknownTokenIdError(field, largest, self.num_token_ids)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any], *, add_generation_prompt: bool,
                    continue_final_message: bool,
                    add_special_tokens: bool = False) -> tuple[str, list[int]]:
        prompt = self.renderer.render(messages, tools, template_kwargs,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message)
        try:
            prompt.encode()
        except UnicodeEncodeError as error:
            # The request's strings are checked for lone surrogates; an escape inside a tool
            # call's arguments string (`"\\ud800"`) becomes one once parsed, and a template
            # that writes the arguments out unescaped puts it in the prompt, which no tokenizer
            # encodes.
            raise ChatRenderError("messages", "the rendered prompt holds a lone surrogate (at "
                                  f"character {error.start}), as an escape such as \\ud800 in a "
                                  "tool call's arguments makes") from None
        # The rendered prompt already carries BOS and every special token it needs, unless the
        # caller asks for the tokenizer's own on top (vLLM's chat `add_special_tokens`).
        return prompt, self.encode(prompt, add_special_tokens=add_special_tokens)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # `encode_batch` of one text costs what `encode` does, and it lets go of the GIL: the
        # service encodes on a worker thread, and `encode` would hold its event loop anyway
        # (a million tokens take 1.6 s).
        return self.fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        # One sequence costs `decode_batch` no more than `decode`, and it lets go of the GIL.
        text = self.fast.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        return self._cleaned(text)

    def decode_each(self, token_ids: list[int]) -> list[str]:
        if len(token_ids) > LONG_DECODE_NUM_TOKENS:
            texts = self.fast.decode_batch([[token_id] for token_id in token_ids],
                                           skip_special_tokens=False)
        else:
            texts = [self.fast.decode([token_id], skip_special_tokens=False)
                     for token_id in token_ids]
        return [self._cleaned(text) for text in texts]

    def decode_in_context(self, token_id: int, context_token_ids: list[int]) -> str:
        """The text `token_id` adds after `context_token_ids` (oldest first), for a token whose
        text alone ends in part of a character: the characters it completes, the bytes earlier
        tokens held of them included, or "" while they are still incomplete."""
        for num_context in range(1, min(len(context_token_ids), MAX_CHARACTER_TOKENS) + 1):
            context = context_token_ids[-num_context:]
            text = self._cleaned(self.fast.decode(context + [token_id], skip_special_tokens=False))
            if text.endswith(REPLACEMENT_CHARACTER):
                continue
            # Context tokens that were pieces of the completed characters showed as "" at their
            # turn: what they hold belongs to this token's text.
            num_whole = len(context)
            while num_whole and self.fast.decode([context[num_whole - 1]]).endswith(REPLACEMENT_CHARACTER):
                num_whole -= 1
            before = self._cleaned(self.fast.decode(context[:num_whole], skip_special_tokens=False))
            return text[len(os.path.commonprefix([before, text])):]
        return ""

    def detokenizer(self, *, skip_special_tokens: bool) -> StreamingDetokenizer:
        # Never cleaned up: vLLM's output text comes from the same `DecodeStream`, which does not.
        return StreamingDetokenizer(self.fast, skip_special_tokens=skip_special_tokens)

    def _cleaned(self, text: str) -> str:
        """`text` as transformers' `decode` finishes it (the tokenizer's own clean-up, which
        remote-code tokenizers may override)."""
        return self.hf.clean_up_tokenization(text) if self.cleans_up_tokenization_spaces else text


class StreamingDetokenizer:
    """Turns token ids arriving in pieces into text deltas that never split a character."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_ids: list[int]) -> str:
        return "".join(self._step(token_id) for token_id in token_ids)

    def _step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tokenizer, token_id) or ""
        except Exception as error:
            if not str(error).startswith(INVALID_PREFIX_ERROR):
                raise
            # A byte-fallback decoder (Llama-2, Mistral, Gemma) turns a byte token's text already
            # sent into U+FFFD once a stray byte follows it, and DecodeStream fails on every later
            # token: start afresh from this one, as vLLM's detokenizer does.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._tokenizer, token_id) or ""


def _model_vocab_size(model_path: str) -> int:
    """config.json's `vocab_size` (a multimodal model's under `text_config`); 0 without one."""
    config = read_model_config(model_path)
    vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return vocab_size if isinstance(vocab_size, int) else 0


def _eos_token_ids(model_path: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from generation_config.json (which may list several) and the tokenizer."""
    ids: list[int] = []
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
