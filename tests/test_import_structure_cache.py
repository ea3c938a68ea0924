"""transformers' import structure kept on disk (slime/utils/import_structure_cache.py): a second process reads the
table the first built, the same table transformers builds, and a changed file gives a new one; what is on disk
is plain data, read only from files private to this user."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from slime.utils.import_structure_cache import _decode, with_disk_cache

ROOT = Path(__file__).resolve().parents[1]

PROCESS = """
import json, os
from pathlib import Path
import slime.utils, transformers
from slime.utils.import_structure_cache import _decode
from transformers.utils import import_utils
scanned = import_utils.create_import_structure_from_path.cache_info().currsize
from transformers import AutoConfig, Qwen3ForCausalLM
models = Path(transformers.__file__).parent / "models"
built = import_utils.define_import_structure.__wrapped__(models, prefix="models")  # a fresh build: transformers
# changes the table it is given in place (its own names), so the one the import used is not it
stored = [_decode(p.read_text()) for p in Path(os.environ["SLIME_CACHE_DIR"]).glob("import-structure-*")]
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
    """Stands in for transformers' function, in its table's shape: the names the folder's one module lists."""

    def __init__(self):
        self.calls = 0

    def __call__(self, module_path, prefix=None):
        self.calls += 1
        text = (Path(module_path) / "configuration_foo.py").read_text()
        names = set(json.loads(text.split("=", 1)[1].replace("'", '"'))) if "__all__" in text else set()
        return {frozenset(): {f"{prefix or 'top'}.configuration_foo": names}, frozenset({"torch"}): {}}


def _names(table) -> set:
    return next(iter(table[frozenset()].values()))


def test_a_changed_added_or_corrupted_file_builds_the_table_again(tmp_path):
    package, cache = tmp_path / "pkg", tmp_path / "cache"
    package.mkdir()
    (package / "configuration_foo.py").write_text('__all__ = ["FooConfig"]\n')
    define = _CountingDefine()

    def fresh_process():  # each process starts with an empty in-memory cache
        return with_disk_cache(define, folder=lambda: cache)

    assert _names(fresh_process()(package, "models")) == {"FooConfig"}
    assert fresh_process()(package, "models") == {frozenset(): {"models.configuration_foo": {"FooConfig"}},
                                                  frozenset({"torch"}): {}} and define.calls == 1
    assert "top.configuration_foo" in fresh_process()(package, None)[frozenset()] and define.calls == 2  # another key

    (package / "configuration_foo.py").write_text('__all__ = ["FooConfig", "BarConfig"]\n')
    assert "BarConfig" in _names(fresh_process()(package, "models")) and define.calls == 3
    (package / "modeling_foo.py").write_text("")
    fresh_process()(package, "models")
    assert define.calls == 4

    for table in cache.glob("import-structure-*.json"):
        table.write_bytes(b"cut short")
    assert "BarConfig" in _names(fresh_process()(package, "models")) and define.calls == 5


def test_a_folder_that_cannot_be_written_still_gives_the_table(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    define = _CountingDefine()
    (tmp_path / "configuration_foo.py").write_text("x = 1\n")
    assert _names(with_disk_cache(define, folder=lambda: blocker / "cache")(tmp_path)) == set()
    assert _names(with_disk_cache(define, folder=lambda: blocker / "cache")(tmp_path)) == set()
    assert define.calls == 2 and not list(tmp_path.glob(".tmp-*"))


class _Planted:
    """A pickle that runs code when unpickled (leaves a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_table_file_anyone_could_plant_never_runs_code_and_only_private_files_are_read(tmp_path):
    package, cache, marker = tmp_path / "pkg", tmp_path / "cache", tmp_path / "ran"
    package.mkdir()
    (package / "configuration_foo.py").write_text('__all__ = ["FooConfig"]\n')
    define = _CountingDefine()
    with_disk_cache(define, folder=lambda: cache)(package, "models")
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    (table,) = cache.glob("import-structure-*")
    assert oct(table.stat().st_mode & 0o777) == "0o600" and define.calls == 1

    table.write_bytes(pickle.dumps(_Planted(marker)))  # what a writer of the cache folder could leave there
    assert _names(with_disk_cache(define, folder=lambda: cache)(package, "models")) == {"FooConfig"}
    assert not marker.exists() and define.calls == 2  # read as data, found not to be a table, built again

    # a well-formed table is read only while the file and its folder are private to this user
    planted = json.dumps([{"backends": [], "modules": {"models.configuration_foo": ["Planted"]}}])
    for entry, shared, private in ((table, 0o664, 0o600), (cache, 0o775, 0o700), (None, None, None)):
        table.write_text(planted)
        table.chmod(0o600)
        if entry is not None:
            entry.chmod(shared)
        seen = _names(with_disk_cache(define, folder=lambda: cache)(package, "models"))
        assert seen == ({"Planted"} if entry is None else {"FooConfig"}), (entry, seen)
        if entry is not None:
            entry.chmod(private)
    table.write_text(json.dumps([{"backends": [], "modules": {"..os": ["system"]}}]))  # a relative module name
    assert _names(with_disk_cache(define, folder=lambda: cache)(package, "models")) == {"FooConfig"}
