"""Session fixtures that build the tiny random-weight models once per test run.

Import them in a conftest: `from tests.models.fixtures import *  # noqa: F403`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny_models import (
    build_deepseek_v4,
    build_glm5_next,
    build_qwen3_5,
    build_qwen4_exp,
)

__all__ = [
    "tiny_deepseek_v4",
    "tiny_glm5_next",
    "tiny_qwen3_5",
    "tiny_qwen4_exp",
]


@pytest.fixture(scope="session")
def tiny_deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a 45 MiB `DeepseekV4ForCausalLM` with its tokenizer (no chat template)."""
    return build_deepseek_v4(tmp_path_factory.mktemp("tiny-deepseek-v4"))


@pytest.fixture(scope="session")
def tiny_glm5_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a `Glm5NextForCausalLM` config, tokenizer and chat template (no weights)."""
    return build_glm5_next(tmp_path_factory.mktemp("tiny-glm5-next"))


@pytest.fixture(scope="session")
def tiny_qwen4_exp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a `Qwen4ExpForCausalLM` with tokenizer and chat template."""
    return build_qwen4_exp(tmp_path_factory.mktemp("tiny-qwen4-exp"))


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a dense `Qwen3_5ForCausalLM` with tokenizer and chat template."""
    return build_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3-5"))
