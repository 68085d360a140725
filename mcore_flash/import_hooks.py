"""Run a function on modules as they are imported (and on those imported already).

Used where another library's module must be adjusted whenever it gets imported: the CPU
view of ``torch`` in megatron modules (:mod:`mcore_flash.platform.megatron_torch_view`), one
megatron module at a time (:func:`on_import`: Megatron-FSDP's adaptations), and the emulated
NPU's storage sharing and DTensor fakes (:mod:`mcore_flash.emulation`).
Standard library only; knows nothing of Megatron or devices.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


class _AfterExecLoader(importlib.abc.Loader):
    """Wraps a module's loader: execute the module, then call ``callback(module)``."""

    def __init__(self, inner, callback: Callable):
        self._inner = inner
        self._callback = callback

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._callback(module)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader, ...
        return getattr(self._inner, name)


class AfterImportFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that lets the other finders find a module named
    ``wanted(name)`` and calls ``callback(module)`` once it has executed."""

    def __init__(self, wanted: Callable[[str], bool], callback: Callable):
        self.wanted = wanted
        self.callback = callback
        self._finding: set[str] = set()  # names this finder asks the others for now

    def find_spec(self, fullname, path, target=None):
        """The other finders' spec for a wanted module, its loader wrapped to call back. Two
        such finders wanting one module each ask the other: the inner one then passes (it
        is finding that name already), so both wrap the loader and both call back."""
        if not self.wanted(fullname) or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _AfterExecLoader(spec.loader, self.callback)
                    return spec
            return None
        finally:
            self._finding.discard(fullname)

    def install(self) -> None:
        """Apply to the modules imported already, then to every later import (idempotent:
        a second finder that :meth:`is_like` one installed is not added)."""
        for name, module in list(sys.modules.items()):
            if module is not None and self.wanted(name):
                self.callback(module)
        if not any(self.is_like(f) for f in sys.meta_path):
            sys.meta_path.insert(0, self)

    def is_like(self, other) -> bool:
        """Whether ``other`` does this finder's job already: one of the same class."""
        return type(other) is type(self)


class ModuleHook(AfterImportFinder):
    """``callback(module)`` for the one module named ``module_name``."""

    def __init__(self, module_name: str, callback: Callable):
        super().__init__(lambda name: name == module_name, callback)
        self.key = (module_name, callback)

    def is_like(self, other) -> bool:
        return type(other) is type(self) and other.key == self.key


def on_import(module_name: str, callback: Callable) -> None:
    """``callback(module)`` on module ``module_name`` now if it is imported, and when it is
    (once per module name and callback)."""
    ModuleHook(module_name, callback).install()
