"""The embedded engine's fast tensor payload: one shared-memory file per bucket and host.

The sender writes a bucket's raw bytes once into a file under /dev/shm (tmpfs: memory, no disk);
every engine on the host maps the same file and copies each tensor straight into its model. Over
HTTP travels only a small JSON descriptor (path, and name/dtype/shape/offset per tensor) in
`serialized_named_tensors[0]` with `load_format="slime_shm"`. Nothing is pickled or base64-encoded.
No pickle also means the receiver never executes sender data.

Only files the run itself made are read: they live in the run's own directory under /dev/shm
(`run_directory`: named after a digest of the run's key, mode 0700, owned by the run's user), are
created 0600 with O_EXCL, and an engine opens a descriptor's path only if it names a regular file
directly inside that directory, owned by its user, through no symlink (O_NOFOLLOW, lstat). Any other
path is refused, so a weight push cannot turn an engine into a reader of other files.

The file belongs to the sender: it is removed once every engine answered for the bucket (a sender that died
mid-push leaves it: a restarted trainer's ranks remove such files before their first push, `remove_buckets`). An engine
of the same dtype keeps the mapped pages as its parameters' storage (a private mapping: pages stay
shared and valid after the unlink, freed when the last engine drops them), so the host holds one
copy of the pushed weights instead of one per engine.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from slime.utils.security import ApiKey

LOAD_FORMAT = "slime_shm"
_ALIGN = 64  # every tensor starts on a cache line, so typed views of the mapping are aligned

NamedTensors = list[tuple[str, torch.Tensor]]


def shared_memory_dir() -> Path:
    """tmpfs where the host has one (Linux /dev/shm), else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SharedPayloadError(ValueError):
    """A descriptor names a file this run did not make (or one that could have been swapped)."""


def run_directory(key: ApiKey) -> Path:
    """The run's directory for shared buckets: the same path for the sender and the engines of a host,
    which no one without the run's key can guess."""
    digest = hashlib.sha256(b"slime-shared-buckets:" + key.reveal().encode()).hexdigest()[:32]
    return shared_memory_dir() / f"slime-{os.getuid()}-{digest}"


def make_run_directory(key: ApiKey) -> Path:
    """Create (or re-use) the run's directory, mode 0700; refuse one that is not private to this user."""
    path = run_directory(key)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private_directory(path)
    return path


def remove_buckets(key: ApiKey) -> int:
    """Remove every bucket left in the run's directory on this host (a sender killed mid-push leaves its file);
    call only while no sender of the run pushes on this host. Returns how many were removed."""
    path = run_directory(key)
    if not path.is_dir():
        return 0
    check_private_directory(path)
    removed = 0
    for bucket in path.glob("*.bin"):
        bucket.unlink(missing_ok=True)
        removed += 1
    return removed


def check_private_directory(path: Path) -> None:
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise SharedPayloadError(f"{path} is not a directory (a symlink or a file is refused)")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise SharedPayloadError(f"{path} must belong to uid {os.getuid()} with mode 0700 "
                                 f"(it has uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})")


@dataclass(frozen=True)
class SharedBucket:
    path: Path
    descriptor: str
    """JSON text the engines receive."""
    nbytes: int

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def write_shared_bucket(named_tensors: NamedTensors, directory: Path, stem: str) -> SharedBucket:
    """Write the tensors' bytes into a new file `directory/stem.bin` (mode 0600) and describe them.
    `directory`: the run's (`make_run_directory`), private to this user."""
    entries, offset = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes])
        offset = _aligned(offset + nbytes)
    check_private_directory(Path(directory))
    path = Path(directory) / f"{stem}.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as handle:  # plain writes: ~3x faster than filling a fresh mapping (no page faults)
        for (_, tensor), (_, _, _, start, _) in zip(named_tensors, entries):
            handle.seek(start)
            handle.write(memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
        handle.truncate(max(offset, 1))
    return SharedBucket(path, json.dumps({"path": str(path), "tensors": entries}), offset)


def read_shared_bucket(descriptor: str, directory: Path) -> NamedTensors:
    """Zero-copy views of a shared bucket in `directory` (the run's); the mapping lives as long as the
    views do. A path elsewhere, a symlink, or a file not private to this user is refused."""
    spec = json.loads(descriptor)
    with _open_private_file(str(spec["path"]), Path(directory)) as handle:
        size = os.fstat(handle.fileno()).st_size
        mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)  # private: views are writable
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    named = []
    for name, dtype, shape, start, nbytes in spec["tensors"]:
        if start + nbytes > size:
            raise ValueError(f"shared bucket {spec['path']}: {name} ends past the file ({start + nbytes} > {size})")
        view = raw[start : start + nbytes].view(_dtype(dtype)).reshape(shape)
        named.append((name, view))
    return named


def _open_private_file(path: str, directory: Path):
    directory = Path(os.path.abspath(directory))
    candidate = Path(os.path.abspath(path))
    if candidate.parent != directory or candidate.name in ("", ".", ".."):
        raise SharedPayloadError(f"shared bucket {path!r} is not a file of this run's directory {directory}")
    check_private_directory(directory)
    try:
        fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:  # ELOOP: a symlink
        raise SharedPayloadError(f"shared bucket {path!r} cannot be opened as a plain file: {exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise SharedPayloadError(f"shared bucket {path!r} is not a regular file private to uid {os.getuid()}")
    return open(fd, "rb")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a shared bucket")
    return dtype


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN
