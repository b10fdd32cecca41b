"""Whole-sequence decodes read as vLLM's, whose tokenizer's `decode` honours the config's
`clean_up_tokenization_spaces`: `/detokenize`, token prompts echoed, logprob token texts. The
tokenizer service as a real process over gRPC, and the gateway's routes over a real mesh.

vLLM's streamed output text comes from the tokenizers library's `DecodeStream`, which never
cleans up: the service's detokenize stream must not either.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

from services.tokenizer.client import TokenizerClient
from tests.conftest import RunningMesh, start_mesh, stop_mesh
from tests.test_tokenizer_service import serve_tokenizer

vllm_tokenizers = pytest.importorskip("vllm.tokenizers", reason="vllm is not installed")
from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens  # noqa: E402

# Spaces a word-splitting tokenizer puts before punctuation and contractions, which the clean-up
# takes out ("Hello, world. Isn't it?").
SPACED_TEXT = "Hello , world . Is n't it ?"
UNIGRAM_PIECES = ["<unk>", "Hello", ",", "world", ".", "Is", "n't", "it", "?"]
# Each folder: how its tokenizer is built and the tokenizer_config.json keys set on top.
# Word-splitting tokenizers (T5's Unigram, BERT's WordPiece) often ship with the clean-up on;
# transformers skips it for BPE tokenizers unless told to corrupt their text anyway.
BPE_CLEAN_UP_FORCED = {"clean_up_tokenization_spaces": True,
                       "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}
TOKENIZERS = {
    "unigram, clean-up on": ("unigram", {"clean_up_tokenization_spaces": True}),
    "unigram, clean-up off": ("unigram", {"clean_up_tokenization_spaces": False}),
    "bpe, clean-up on (ignored)": ("bpe", {"clean_up_tokenization_spaces": True}),
    "bpe, clean-up forced": ("bpe", BPE_CLEAN_UP_FORCED),
}


def _unigram_tokenizer() -> Tokenizer:
    """Words split on whitespace and joined by spaces again: no decoder takes a space out."""
    tokenizer = Tokenizer(models.Unigram([(piece, -1.0) for piece in UNIGRAM_PIECES], unk_id=0))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def model_folder(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory, kind: str,
                 config_keys: dict[str, bool]) -> Path:
    """The embedded model's tokenizer files, with the tokenizer and its config changed."""
    folder = tmp_path_factory.mktemp("clean-up-model")
    for path in embedded_model_path.iterdir():
        if path.suffix in (".json", ".jinja"):
            shutil.copy(path, folder / path.name)
    if kind == "unigram":
        _unigram_tokenizer().save(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | config_keys))
    return folder


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def model(request: pytest.FixtureRequest, embedded_model_path: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_folder(embedded_model_path, tmp_path_factory, *TOKENIZERS[request.param])


@pytest.fixture(scope="module")
def tokenizer_address(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve_tokenizer(model, tmp_path_factory)


async def _service_texts(address: str, token_ids: list[int]) -> tuple[str, list[str]]:
    client = TokenizerClient(address)
    try:
        return (await client.decode(token_ids, skip_special_tokens=False),
                await client.token_texts(token_ids))
    finally:
        await client.close()


def test_decodes_read_as_vllms_tokenizer_decodes_them(model: Path, tokenizer_address: str) -> None:
    reference = vllm_tokenizers.get_tokenizer(str(model))
    token_ids = reference.encode(SPACED_TEXT, add_special_tokens=False)
    text, token_texts = asyncio.run(_service_texts(tokenizer_address, token_ids))
    # `/detokenize` and a token prompt's echo (vLLM: the renderer's `tokenizer.decode`).
    assert text == reference.decode(token_ids)
    # Logprob token texts (vLLM: each token through `tokenizer.decode`).
    assert token_texts == convert_ids_list_to_tokens(reference, token_ids)


async def _streamed_text(address: str, token_ids: list[int]) -> str:
    client = TokenizerClient(address)
    stream = client.detokenizer(skip_special_tokens=False, prompt_token_ids=[])
    try:
        return "".join([await stream.step([token_id]) for token_id in token_ids])
    finally:
        stream.close()
        await client.close()


def test_streamed_text_reads_as_vllms_output_text(model: Path, tokenizer_address: str) -> None:
    reference = vllm_tokenizers.get_tokenizer(str(model))
    token_ids = reference.encode(SPACED_TEXT, add_special_tokens=False)
    # What vLLM's incremental detokenizer does for a fast tokenizer.
    decode_stream = DecodeStream(skip_special_tokens=False)
    expected = "".join(decode_stream.step(reference.backend_tokenizer, token_id) or "" for token_id in token_ids)
    assert asyncio.run(_streamed_text(tokenizer_address, token_ids)) == expected


@pytest.fixture(scope="module")
def clean_up_mesh(embedded_model_path: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, RunningMesh]]:
    """`backport up` on the embedded model whose tokenizer config forces the clean-up."""
    folder = model_folder(embedded_model_path, tmp_path_factory, "bpe", BPE_CLEAN_UP_FORCED)
    (folder / "model.safetensors").symlink_to(embedded_model_path / "model.safetensors")
    mesh = start_mesh(tmp_path_factory.mktemp("mesh"), "--model", str(folder), "--max-model-len", "512")
    yield folder, mesh
    stop_mesh(mesh)


def test_detokenize_and_an_echoed_token_prompt_read_as_vllms(
        clean_up_mesh: tuple[Path, RunningMesh]) -> None:
    folder, mesh = clean_up_mesh
    reference = vllm_tokenizers.get_tokenizer(str(folder))
    token_ids = reference.encode(SPACED_TEXT, add_special_tokens=False)
    expected = reference.decode(token_ids)
    assert expected == "Hello, world. Isn't it?"  # what vLLM's server answers for this model
    reply = httpx.post(f"{mesh.base_url.removesuffix('/v1')}/detokenize", json={"tokens": token_ids},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["prompt"] == expected
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0, timeout=120)
    served_model = client.models.list().data[0].id
    echoed = client.completions.create(model=served_model, prompt=token_ids, max_tokens=1,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(expected)
