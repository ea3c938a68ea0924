"""transformers' import structure, built once per installed transformers instead of once per process.

`import transformers` builds the table of the names its model packages export by reading every one of their
~2,600 files for `__all__` (`transformers.utils.import_utils.define_import_structure`): ~0.6 CPU-s in every
process that imports it, and every rank, engine and driver of a run does. The table depends only on those
files, so it is kept on disk under a key of the folder, the prefix and the (mtime, size) of every .py file in
the folder (a changed, added or removed file gives a new key); a process that finds it spends ~0.1 CPU-s on
the key and the read.

`cache_transformers_import_structure()` runs when slime.utils is first imported (its __init__), which every
process of a run does before it imports transformers: it adds an import hook that wraps the function as
transformers loads the module that defines it. A process that imported transformers earlier keeps
transformers' own. Where the cache folder cannot be written, the table is built as transformers builds it.
Folder: $SLIME_CACHE_DIR, else $XDG_CACHE_HOME/slime, else ~/.cache/slime.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

TARGET_MODULE = "transformers.utils.import_utils"
FORMAT = 1  # bump when what is stored changes


def cache_dir() -> Path:
    explicit = os.environ.get("SLIME_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slime"


def cache_transformers_import_structure() -> None:
    """Install the hook once per process, unless transformers' module is loaded already."""
    if TARGET_MODULE in sys.modules or any(isinstance(f, _WrapOnLoad) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _WrapOnLoad())


def with_disk_cache(define: Callable[..., Any], folder: Callable[[], Path] = cache_dir) -> Callable[..., Any]:
    """`define(module_path, prefix=None)`, its results kept in `folder()` under the key of the files it reads."""

    fingerprint = functools.lru_cache(_files_fingerprint)  # transformers asks twice about its models folder

    @functools.lru_cache
    def define_import_structure(module_path, prefix=None):
        path = folder() / f"import-structure-{_key(module_path, prefix, fingerprint)}.pickle"
        try:
            return pickle.loads(path.read_bytes())
        except Exception:  # absent, unreadable or cut short by a writer that died: build it again
            pass
        structure = define(module_path, prefix)
        _write(path, structure)  # before transformers adds its own names to the table it returns
        return structure

    define_import_structure.__wrapped__ = define
    return define_import_structure


class _WrapOnLoad(importlib.abc.MetaPathFinder):
    """Finds transformers' import_utils as the path finder does and wraps its function once it has run."""

    def find_spec(self, name, path, target=None):
        if name != TARGET_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)  # None: the finders after this one look
        if spec is not None and spec.loader is not None:
            spec.loader = _WrappingLoader(spec.loader)
        return spec


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module keeps its own loader
        self.loader.exec_module(module)
        define = getattr(module, "define_import_structure", None)
        if callable(define):  # a transformers without it is left as it is
            module.define_import_structure = with_disk_cache(define)


def _key(module_path, prefix, fingerprint: Callable[[str], str]) -> str:
    root = Path(module_path)
    folder = root.parent if root.is_file() else root  # transformers reads the folder of a file it is given
    digest = hashlib.sha256(f"{FORMAT}|{sys.version_info[:2]}|{module_path}|{prefix}|".encode())
    digest.update(fingerprint(str(folder)).encode())
    return digest.hexdigest()[:32]


def _files_fingerprint(folder: str) -> str:
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                stat = os.stat(os.path.join(dirpath, name))
                digest.update(f"{dirpath}/{name}:{stat.st_mtime_ns}:{stat.st_size}\n".encode())
    return digest.hexdigest()


def _write(path: Path, structure: Any) -> None:
    """Whole or not at all: processes that start together may write the same key."""
    tmp = None
    try:
        data = pickle.dumps(structure)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, path)
    except Exception:  # a read-only home, a table pickle cannot write: built in every process, as without this
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)
