"""Runs a patch on a vLLM module as soon as it has been imported.

The backport's seams are names that vLLM's model modules look up when they run. Patching
them right after vLLM imports the module means a model that never loads the module never
loads any of the backport's code for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping
from types import ModuleType

ModulePatch = Callable[[ModuleType], None]


class PatchOnImport(importlib.abc.MetaPathFinder):
    """A finder that wraps the loaders of the named modules so their patch runs right
    after the module's code."""

    def __init__(self, patches: Mapping[str, ModulePatch]) -> None:
        self.patches = dict(patches)

    def find_spec(self, fullname: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: ModulePatch) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


def patch_when_imported(patches: Mapping[str, ModulePatch]) -> PatchOnImport:
    """Patches the modules already imported now and the others when they are; returns the
    finder, which `stop_patching` removes."""
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    finder = PatchOnImport(patches)
    sys.meta_path.insert(0, finder)
    return finder


def stop_patching(finder: PatchOnImport) -> None:
    """Stops patching modules imported from now on (patches already made stay)."""
    sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]
