"""Small helpers shared by the rest of the package: dotted-path loading and a singleton metaclass."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import threading
from typing import Any, Callable


_hook_lock = threading.RLock()


def split_function_path(path: str) -> tuple[str, str]:
    """Split a hook path into (module or file, attribute).

    Accepted forms: ``"pkg.module.func"`` and ``"path/to/file.py:func"`` (upstream examples use both).
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"function path must be a non-empty string, got {path!r}")
    path = path.strip()
    if ":" in path:
        module_part, _, attr = path.rpartition(":")
    else:
        module_part, _, attr = path.rpartition(".")
    if not module_part or not attr:
        raise ValueError(f"function path {path!r} must look like 'pkg.module.func' or 'file.py:func'")
    return module_part, attr


def hook_module_name(file_path: str) -> str:
    """The sys.modules name of a hook file: one per absolute path, so each file is executed once."""
    real = os.path.realpath(file_path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(real))[0])
    return f"_slime_hook_{stem}_{hashlib.sha1(real.encode()).hexdigest()[:12]}"


def _import_from_file(file_path: str, origin: str) -> Any:
    """Execute a hook file once per process (as `import` would) and return the same module afterwards:
    module-level state of a hook (caches, counters, clients) survives between calls."""
    if not os.path.isfile(file_path):
        raise ModuleNotFoundError(f"cannot load {origin!r}: file {file_path!r} does not exist")
    module_name = hook_module_name(file_path)
    with _hook_lock:
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, file_path)
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError(f"cannot load {origin!r}: {file_path!r} is not an importable Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # registered first, as import does: the file may import itself
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]  # a failed load is retried next time, not half-cached
            raise
        return module


def _import_module(module_part: str, origin: str) -> Any:
    if module_part.endswith(".py") or os.sep in module_part:
        return _import_from_file(module_part, origin)
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as exc:
        # Only translate "this very module is missing"; an ImportError raised inside the module propagates as is.
        if exc.name is not None and (module_part == exc.name or module_part.startswith(exc.name + ".")):
            raise ModuleNotFoundError(
                f"cannot load {origin!r}: module {module_part!r} not found (missing: {exc.name!r})", name=exc.name
            ) from exc
        raise


def load_function(path: str) -> Callable[..., Any]:
    """Import ``path`` ("pkg.module.func" or "file.py:func") and return the attribute it names.

    Errors name the full path and the missing part, so a typo in a ``--custom-*-path`` flag is obvious.
    """
    module_part, attr = split_function_path(path)
    module = _import_module(module_part, path)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"cannot load {path!r}: module {module_part!r} has no attribute {attr!r}") from None


def module_is_findable(path: str) -> bool:
    """True if the module (or file) part of a function path can be found without executing it."""
    module_part, _ = split_function_path(path)
    if module_part.endswith(".py") or os.sep in module_part:
        return os.path.isfile(module_part)
    try:
        return importlib.util.find_spec(module_part) is not None
    except ValueError:
        return False
    except ModuleNotFoundError as exc:
        # find_spec imports parents; a missing parent package means the module is missing too. A parent that
        # exists but fails to import a dependency of its own is that parent's error, not a missing module.
        if exc.name is None or module_part == exc.name or module_part.startswith(exc.name + "."):
            return False
        raise


class SingletonMeta(type):
    """Metaclass: one instance per class per process (e.g. a process-wide registry)."""

    _instances: dict[type, Any] = {}
    _lock = threading.Lock()

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        with SingletonMeta._lock:
            if cls not in SingletonMeta._instances:
                SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
            return SingletonMeta._instances[cls]

    @staticmethod
    def reset(cls: type) -> None:
        """Forget the instance of ``cls`` (tests, re-initialisation)."""
        with SingletonMeta._lock:
            SingletonMeta._instances.pop(cls, None)


def ceil_div(a: int, b: int) -> int:
    """Integer ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= value."""
    return ceil_div(value, multiple) * multiple
