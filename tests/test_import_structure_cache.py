"""transformers' import structure kept on disk (slime/utils/import_structure_cache.py): a second process reads the
table the first built, the same table transformers builds, and a changed file gives a new one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from slime.utils.import_structure_cache import with_disk_cache

ROOT = Path(__file__).resolve().parents[1]

PROCESS = """
import json, os, pickle
from pathlib import Path
import slime.utils, transformers
from transformers.utils import import_utils
scanned = import_utils.create_import_structure_from_path.cache_info().currsize
from transformers import AutoConfig, Qwen3ForCausalLM
models = Path(transformers.__file__).parent / "models"
built = import_utils.define_import_structure.__wrapped__(models, prefix="models")  # a fresh build: transformers
# changes the table it is given in place (its own names), so the one the import used is not it
stored = [pickle.loads(p.read_bytes()) for p in Path(os.environ["SLIME_CACHE_DIR"]).glob("import-structure-*")]
print(json.dumps({"scanned": scanned, "stored": built in stored, "qwen3": "models.qwen3.modeling_qwen3" in str(built),
                  "model_type": AutoConfig.for_model("qwen3").model_type, "class": Qwen3ForCausalLM.__name__}))
"""


def _process(cache: Path) -> dict:
    env = {"PATH": "/usr/bin:/bin", "SLIME_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROCESS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_table_the_first_built_and_it_is_transformers_own(tmp_path):
    first = _process(tmp_path)
    assert first["scanned"] > 0 and first["stored"] and first["qwen3"]  # built from the files, then written
    second = _process(tmp_path)
    assert second["scanned"] == 0  # no file of transformers' models was read for the table
    assert second["stored"]  # the table on disk is what transformers builds (built again here to compare)
    assert second["model_type"] == "qwen3" and second["class"] == "Qwen3ForCausalLM"


class _CountingDefine:
    """Stands in for transformers' function: the table is the text of the folder's one module."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module_path, prefix=None):
        self.calls += 1
        return {"prefix": prefix, "text": (Path(module_path) / "configuration_foo.py").read_text()}


def test_a_changed_added_or_corrupted_file_builds_the_table_again(tmp_path):
    package, cache = tmp_path / "pkg", tmp_path / "cache"
    package.mkdir()
    (package / "configuration_foo.py").write_text('__all__ = ["FooConfig"]\n')
    define = _CountingDefine()

    def fresh_process():  # each process starts with an empty in-memory cache
        return with_disk_cache(define, folder=lambda: cache)

    assert fresh_process()(package, "models")["text"] == '__all__ = ["FooConfig"]\n'
    assert fresh_process()(package, "models")["text"] == '__all__ = ["FooConfig"]\n' and define.calls == 1
    assert fresh_process()(package, None)["prefix"] is None and define.calls == 2  # another prefix, another key

    (package / "configuration_foo.py").write_text('__all__ = ["FooConfig", "BarConfig"]\n')
    assert "BarConfig" in fresh_process()(package, "models")["text"] and define.calls == 3
    (package / "modeling_foo.py").write_text("")
    fresh_process()(package, "models")
    assert define.calls == 4

    for table in cache.glob("import-structure-*.pickle"):
        table.write_bytes(b"cut short")
    assert "BarConfig" in fresh_process()(package, "models")["text"] and define.calls == 5


def test_a_folder_that_cannot_be_written_still_gives_the_table(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    define = _CountingDefine()
    (tmp_path / "configuration_foo.py").write_text("x = 1\n")
    assert with_disk_cache(define, folder=lambda: blocker / "cache")(tmp_path)["text"] == "x = 1\n"
    assert with_disk_cache(define, folder=lambda: blocker / "cache")(tmp_path)["text"] == "x = 1\n"
    assert define.calls == 2 and not list(tmp_path.glob(".tmp-*"))
