"""SGLang's own files for the contract tests, one unpacked wheel per supported version.

The wheels are fetched with pip (`pip download --no-deps`: no CUDA torch comes along) into a cache
outside the repository and unpacked; nothing is installed. The versions are the range setup.py
declares for the [gpu] extra. `python tests/sglang_files.py` fetches them ahead (make setup does).
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SLIME_SGLANG_CACHE", Path.home() / ".cache" / "slime-fenced" / "sglang"))


def supported_versions() -> tuple[str, str]:
    """(oldest, newest) as setup.py declares them."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
            names = [t.id for t in node.targets[0].elts]
            if names == ["SGLANG_OLDEST", "SGLANG_NEWEST"]:
                return tuple(ast.literal_eval(node.value))
    raise LookupError("setup.py declares no SGLANG_OLDEST, SGLANG_NEWEST")


def sglang_root(version: str) -> Path:
    """A directory holding the unpacked `sglang` package of `version` (fetched on first use)."""
    target = CACHE / version
    if (target / "sglang" / "srt" / "server_args.py").is_file():
        return target
    wheels = CACHE / "wheels" / version
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("sglang-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "-d", str(wheels), f"sglang=={version}"], check=True, timeout=600)
    wheel = next(wheels.glob("sglang-*.whl"))
    partial = CACHE / f"{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted unpack
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(partial, [n for n in archive.namelist() if n.startswith("sglang/")])
    partial.rename(target)
    return target


if __name__ == "__main__":
    for v in supported_versions():
        print(v, sglang_root(v))
