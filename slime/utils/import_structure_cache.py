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

Every process of a run holds the run's key, so what it reads here must not be able to run code: the table is
plain data stored as JSON (backends, module names, exported names: strings only, checked on read), and a file
is read only when it and its folder belong to this user and nobody else may write them; anything else is
ignored and the table built as transformers builds it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

TARGET_MODULE = "transformers.utils.import_utils"
FORMAT = 2  # bump when what is stored changes
# backends ("torch", "torch>=2.5"), modules under transformers' package (never relative), exported names
_PLAIN_NAME = re.compile(r"[A-Za-z_][\w.-]*(?:[<>=!~]=?[\w.]+)?")


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
        path = folder() / f"import-structure-{_key(module_path, prefix, fingerprint)}.json"
        try:
            return _decode(_read_private(path))
        except (OSError, ValueError, TypeError, KeyError):  # absent, not ours, cut short or not a table: build it
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


def _read_private(path: Path) -> str:
    """The file's text, if it and its folder are this user's and writable by nobody else (else OSError)."""
    for entry in (path.parent, path):
        info = entry.lstat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or stat.S_ISLNK(info.st_mode):
            raise PermissionError(f"{entry} is not private to this user")
    return path.read_text()


def _encode(structure: Any) -> str:
    """transformers' table, {frozenset(backends): {module: set(names)}}, as JSON rows (TypeError on another shape)."""
    rows = []
    for backends, modules in structure.items():
        if not isinstance(backends, frozenset) or not isinstance(modules, dict):
            raise TypeError(f"not an import structure: {type(backends).__name__} -> {type(modules).__name__}")
        rows.append({"backends": sorted(backends),
                     "modules": {module: sorted(names) for module, names in modules.items()}})
    return json.dumps(rows)


def _decode(text: str) -> dict:
    """The table back from its JSON rows; ValueError unless it has the table's shape, and plain names only."""
    table = {}
    for row in json.loads(text):
        backends, modules = row["backends"], row["modules"]
        if not isinstance(backends, list) or not isinstance(modules, dict) or \
                not all(isinstance(names, list) for names in modules.values()):
            raise ValueError("not an import structure")
        if not all(isinstance(name, str) and _PLAIN_NAME.fullmatch(name)
                   for name in (*backends, *modules, *(n for names in modules.values() for n in names))):
            raise ValueError("not an import structure")
        table[frozenset(backends)] = {module: set(names) for module, names in modules.items()}
    return table


def _write(path: Path, structure: Any) -> None:
    """Whole or not at all: processes that start together may write the same key. The folder is made private
    (0700) and the file written 0600."""
    tmp = None
    try:
        text = _encode(structure)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp-", delete=False) as tmp:  # 0600
            tmp.write(text)
        os.replace(tmp.name, path)
    except Exception:  # a read-only home, a table of another shape: built in every process, as without this
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)
