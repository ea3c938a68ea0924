"""Writes that survive a crash or a power cut: files and the directories naming them are fsynced, and
a finished directory replaces an older one of the same name without a moment where neither exists.

A rename is atomic but not durable until its directory is fsynced; a file's bytes are durable once it
is fsynced. Everything --load reads goes through these helpers.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
from typing import IO, Callable

PARTIAL = ".partial"
_RENAME_EXCHANGE = 2  # linux/fs.h: swap the two names atomically


def fsync_path(path: str) -> None:
    """fsync one file or directory (a directory: the names in it)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str, progress: Callable[[], None] | None = None) -> None:
    """Every file under root, then every directory bottom-up, root included; progress() after each."""
    for base, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(base, name))
            if progress is not None:
                progress()
        fsync_path(base)


def write_atomic(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """write(f) into path.partial, fsync it, rename it over path, fsync the directory: a reader sees the
    old file or the whole new one, also after a crash."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    partial = path + PARTIAL
    with open(partial, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    fsync_path(directory)


def write_text_atomic(path: str, text: str) -> None:
    write_atomic(path, lambda handle: handle.write(text.encode()))


def publish_dir(partial: str, path: str, progress: Callable[[], None] | None = None, *, in_use: bool = True) -> None:
    """Put the finished directory `partial` in place as `path`; the parent directory is fsynced.
    An existing `path` that is `in_use` (what a reader may load now) is swapped out in one atomic exchange
    (it is never missing) and removed after; one that is not (a save that never became current) is removed
    first, so that a filesystem without the exchange (NFS) can save the same iteration again.
    `progress()` is called after each file is fsynced (peers waiting for this work see it move)."""
    parent = os.path.dirname(os.path.abspath(path))
    fsync_tree(partial, progress)
    if os.path.exists(path) and in_use:
        exchange(partial, path)  # `partial` now names the older directory
        fsync_path(parent)
        shutil.rmtree(partial)
    else:
        if os.path.exists(path):
            shutil.rmtree(path)
            fsync_path(parent)
        os.replace(partial, path)
    fsync_path(parent)


def exchange(a: str, b: str) -> None:
    """Swap two names atomically (Linux renameat2 RENAME_EXCHANGE); raise OSError where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available: cannot replace a saved iteration atomically", b)
    at_cwd = -100  # AT_FDCWD
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"atomic exchange of {a} and {b} failed: {os.strerror(code)}", b)
