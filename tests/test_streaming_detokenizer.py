"""Incremental detokenization in the tokenizer core, on a Llama-2-style byte-fallback tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models

from services.tokenizer.core import TokenizerCore

# Sentencepiece pieces plus one token per byte, as Llama-2's, Mistral's and Gemma's vocabularies
# hold them: "\n" and characters outside the pieces decode from byte tokens.
WORDS = ("▁hello", "▁world", ".")
VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
VOCAB |= {word: len(VOCAB) + i for i, word in enumerate(WORDS)}


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> TokenizerCore:
    folder = tmp_path_factory.mktemp("byte-fallback-tokenizer")
    tokenizer = Tokenizer(models.BPE(VOCAB, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    return TokenizerCore(str(folder))


def test_a_stray_byte_after_a_byte_token_does_not_end_the_stream(core: TokenizerCore) -> None:
    # "\n" is the byte token <0x0A>; a sampled lone lead byte after it makes the decoder show
    # both as U+FFFD, so the text no longer starts with the "\n" already sent. DecodeStream
    # raised on that token and on every one after it, which failed the whole completion.
    token_ids = [VOCAB["▁hello"], VOCAB["<0x0A>"], VOCAB["<0xE4>"], VOCAB["▁world"], VOCAB["."]]
    detokenizer = core.detokenizer(skip_special_tokens=True)
    deltas = [detokenizer.step([token_id]) for token_id in token_ids]
    # vLLM's detokenizer recovers the same way: the stray byte is dropped, decoding goes on.
    assert deltas == ["hello", "\n", "", "world", "."]
