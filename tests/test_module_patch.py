"""module_patch: a patch runs on a module right after it is imported, or at once when it
already is, and stops after `stop_patching`."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from services.engine.backport.module_patch import patch_when_imported, stop_patching


def _write_module(directory, name: str) -> None:
    (directory / f"{name}.py").write_text("def answer():\n    return 1\n")


def _patch(module: ModuleType) -> None:
    module.answer = lambda: 2


def test_patch_runs_when_the_module_is_imported_and_stops_after(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("backport_patch_early", "backport_patch_late", "backport_patch_after"):
        _write_module(tmp_path, name)
    early = importlib.import_module("backport_patch_early")
    finder = patch_when_imported({name: _patch for name in (
        "backport_patch_early", "backport_patch_late", "backport_patch_after")})
    try:
        assert early.answer() == 2  # already imported: patched at once
        assert importlib.import_module("backport_patch_late").answer() == 2
    finally:
        stop_patching(finder)
    assert finder not in sys.meta_path
    assert importlib.import_module("backport_patch_after").answer() == 1
    for name in ("backport_patch_early", "backport_patch_late", "backport_patch_after"):
        sys.modules.pop(name, None)
