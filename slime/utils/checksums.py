"""Byte digests by upstream slime's checksum names (`--update-weight-delta-checksum`).

adler32 comes with zlib; xxh3-128 and blake3 need their packages, which this project does not require:
`missing_package` names the one to install before a run that asks for them starts.
"""
from __future__ import annotations

import importlib.util
import zlib

CHECKSUMS = ("xxh3-128", "blake3", "adler32")
PACKAGES = {"xxh3-128": "xxhash", "blake3": "blake3"}


def missing_package(checksum: str) -> str | None:
    """The package `checksum` needs that this interpreter lacks (None: usable)."""
    if checksum not in CHECKSUMS:
        raise ValueError(f"checksum {checksum!r}; expected one of {CHECKSUMS}")
    package = PACKAGES.get(checksum)
    return package if package and importlib.util.find_spec(package) is None else None


def hexdigest(data: bytes, checksum: str) -> str:
    if checksum == "adler32":
        return f"{zlib.adler32(data):08x}"
    if checksum == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128_hexdigest(data)
    if checksum == "blake3":
        import blake3

        return blake3.blake3(data).hexdigest()
    raise ValueError(f"checksum {checksum!r}; expected one of {CHECKSUMS}")
