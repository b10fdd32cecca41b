"""A small byte-level BPE tokenizer trained in-process, for tiny random-weight models.

Byte-level pre-tokenization means any text (full-width bars, JSON, CJK) encodes, so
prompts rendered by the real encoders round-trip. Training on a fixed corpus is
deterministic and takes well under a second.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Text the merges are learned from: chat, code and tool-call shapes, so common
# prompt pieces become single tokens and long prompts stay a predictable length.
_TRAINING_LINES = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer the user's question briefly and politely.",
    "What is the weather like in Berlin today? It is sunny with a light breeze.",
    'def add(a: int, b: int) -> int:\n    return a + b\n\nprint(add(2, 3))',
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '<parameter name="city" string="true">Paris</parameter>\n<invoke name="search">',
    "## Tools\n\nYou have access to a set of tools to help answer the question.",
    "Reasoning Effort: think step by step, check every assumption, then answer.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 -42 true false null [] {} () <> </>",
    "numbers letters words sentences paragraphs documents tokens vocabulary model",
)


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What a family's tokenizer must carry.

    `special_tokens` are control tokens dropped by `skip_special_tokens`;
    `marker_tokens` are added as single tokens that stay in decoded text
    (reasoning and tool markup the output parsers read).
    """

    bos_token: str | None
    eos_token: str
    pad_token: str
    special_tokens: tuple[str, ...]
    marker_tokens: tuple[str, ...] = ()
    chat_template: str | None = None
    vocab_size: int = 1024
    extra_config: dict[str, object] = field(default_factory=dict)


def train_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Train a byte-level BPE whose vocabulary, specials included, is `spec.vocab_size`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    named = [t for t in (spec.bos_token, spec.eos_token, spec.pad_token) if t]
    specials = list(dict.fromkeys([*named, *spec.special_tokens]))
    markers = [t for t in dict.fromkeys(spec.marker_tokens) if t not in specials]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(markers),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    # Markers come last as plain added tokens: single ids that survive
    # skip_special_tokens, as reasoning and tool markup do in the real vocabularies.
    tokenizer.add_tokens(markers)
    return tokenizer


def _training_corpus() -> list[str]:
    """The fixed lines plus seeded pseudo-words, enough text to learn ~1k merges."""
    rng = random.Random(20261130)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "von", "ber", "qua", "ex", "in"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(600)]
    pseudo = [" ".join(rng.choices(words, k=12)) for _ in range(400)]
    return [*(_TRAINING_LINES * 8), *pseudo]


def save_tokenizer(spec: TokenizerSpec, folder: Path) -> Tokenizer:
    """Train and write `tokenizer.json` and `tokenizer_config.json` into `folder`."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_tokenizer(spec)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=spec.bos_token,
        eos_token=spec.eos_token,
        pad_token=spec.pad_token,
        additional_special_tokens=list(spec.special_tokens),
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
        **spec.extra_config,
    )
    if spec.chat_template is not None:
        wrapped.chat_template = spec.chat_template
    wrapped.save_pretrained(str(folder))
    return tokenizer
