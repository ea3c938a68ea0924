"""SGLang's own files for the contract tests, one unpacked wheel per supported version.

The wheels are fetched with pip (`pip download --no-deps`: no CUDA torch comes along) into a cache
outside the repository and unpacked; nothing is installed. The versions are the range setup.py
declares for the [gpu] extra. `python tests/sglang_files.py` fetches them ahead (make setup does).

`python tests/sglang_files.py --write-server-options` regenerates slime/utils/sglang_server_options.py: every
option of SGLang's launch parser in each supported version, what `--sglang-<name>` is checked against where
sglang does not import (tests/test_sglang_contract.py keeps it equal to SGLang's files).
"""
from __future__ import annotations

import ast
import json
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


SERVER_OPTIONS_MODULE = ROOT / "slime" / "utils" / "sglang_server_options.py"


def probe_server_options(version: str) -> list[str]:
    """The option strings of SGLang `version`'s launch parser, read by tests/sglang_probe.py."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sglang_root(version)), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sglang_probe.py"), "--server-options"],
                          capture_output=True, text=True, env=env, timeout=240, cwd=str(ROOT), check=True)
    return json.loads(proc.stdout)["server_options"]


def render_server_options(by_version: dict[str, list[str]]) -> str:
    """The generated module: option -> the supported versions whose launch parser has it."""
    versions: dict[str, list[str]] = {}
    for version, options in by_version.items():
        for option in options:
            versions.setdefault(option, []).append(version)
    lines = [
        '"""SGLang\'s launch-parser options, per supported version. Generated: python tests/sglang_files.py',
        "--write-server-options (tests/test_sglang_contract.py keeps it equal to SGLang's own files)."
        '"""',
        "",
        f"VERSIONS = {tuple(by_version)!r}",
        "",
        "SERVER_OPTIONS: dict[str, tuple[str, ...]] = {",
        *(f"    {option!r}: {tuple(vs)!r}," for option, vs in sorted(versions.items())),
        "}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-server-options"]:
        SERVER_OPTIONS_MODULE.write_text(render_server_options({v: probe_server_options(v) for v in supported_versions()}))
        print("wrote", SERVER_OPTIONS_MODULE)
        sys.exit(0)
    for v in supported_versions():
        print(v, sglang_root(v))
