"""Run a function right after a module is first imported (``after_import``).

``import specla_hf`` imports no model library: what SpecLA installs into one (a ``generate`` that takes an assistant,
a CPU path for Triton-only ops, Auto-class registrations) runs when the user's code imports that library.
"""
from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType

_WAITING: dict[str, list[Callable[[ModuleType], None]]] = {}


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it asks the other finders, then makes the loader run the
    module's waiting functions once the module has executed."""

    def find_spec(self, name, path, target=None):
        if name not in _WAITING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for fn in _WAITING.pop(name, []):
                fn(module)
        loader.exec_module = exec_module
        return spec


_FINDER = _AfterImportFinder()


def after_import(name: str, fn: Callable[[ModuleType], None]) -> None:
    """Call ``fn(module)`` once module ``name`` is imported: now if it already is."""
    module = sys.modules.get(name)
    if module is not None:
        fn(module)
        return
    _WAITING.setdefault(name, []).append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
