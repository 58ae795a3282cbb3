"""Run a function once a module has finished importing.

sntf must not import TensorFlow (or Keras) on its own schedule when it is
switched on from the environment: a script sets TF_* variables before its
own `import tensorflow`, and Keras' trainer modules must not be imported
while Keras itself is half imported. So work that needs them waits here for
their import, as coverage.py's and wrapt's post-import hooks do: a one-shot
finder on sys.meta_path wraps the module's loader, and the callbacks run
right after the module's code has run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from typing import Callable

logger = logging.getLogger("sntf")
_lock = threading.Lock()
_waiting: dict[str, list[Callable]] = {}


def imported(name: str) -> bool:
    """Whether module `name` is in sys.modules and has finished importing."""
    module = sys.modules.get(name)
    if module is None:
        return False
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def when_imported(name: str, callback: Callable[[object], None]) -> bool:
    """Calls callback(module) once module `name` has finished importing: now
    if it has, else right after its import.

    A callback that raises is logged and dropped: it must never fail the
    user's import.

    Args:
      name: the module's full name, e.g. "tensorflow".
      callback: called with the module, once.

    Returns:
      Whether the callback ran now.
    """
    if imported(name):
        _call(name, callback, sys.modules[name])
        return True
    with _lock:
        first = name not in _waiting
        _waiting.setdefault(name, []).append(callback)
        if first and not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    return False


def pending(name: str) -> int:
    """How many callbacks wait for module `name` (for tests)."""
    with _lock:
        return len(_waiting.get(name, ()))


def _call(name: str, callback: Callable, module) -> None:
    try:
        callback(module)
    except Exception:  # noqa: BLE001 - the user's import must go on
        logger.exception("a hook run after importing %s failed", name)


class _Loader(importlib.abc.Loader):
    """The module's own loader, followed by the callbacks waiting for it."""

    def __init__(self, name: str, loader):
        self._name = name
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # The module sees its real loader (TensorFlow and Keras read their
        # own __loader__/__spec__ in places).
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with _lock:
            callbacks = _waiting.pop(self._name, [])
            if not _waiting:
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        for callback in callbacks:
            _call(self._name, callback, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of a module someone waits for; finds nothing itself."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        with _lock:
            wanted = fullname in _waiting
        if not wanted or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            # The other finders, as the import system would ask them.
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.active = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(fullname, spec.loader)
        return spec
