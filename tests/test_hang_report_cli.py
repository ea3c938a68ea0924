"""`python -m slime.distributed.hang_report DIR`: the table of a run from another shell, from its files."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slime.distributed import Ledger

ROOT = Path(__file__).resolve().parents[1]


def _hang_report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime.distributed.hang_report", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_renders_the_live_table_with_one_word_for_the_rank_to_blame(tmp_path):
    # rank 0 waits in a cp all_reduce for rank 1, which never started it: rank 1 is to blame
    waiting, behind = Ledger(0, 2, str(tmp_path)), Ledger(1, 2, str(tmp_path))
    with waiting.phase("actor_train/forward_backward"):
        waiting.begin_named("all_reduce", "cp", (0, 1), (4,), "float32")
        waiting.flush()
        behind.flush()
        proc = _hang_report(str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = lines[0].split()
    assert header == ["rank", "verdict", "phase", "op", "group", "waiting", "progress", "seq", "file", "age"]
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert rows["0"][1:5] == ["waiting", "actor_train/forward_backward", "all_reduce", "cp[0,1]"]
    assert rows["1"][1] == "SUSPECT"
    assert "most waited-on (suspects): [1]" in proc.stdout
    waiting.close()
    behind.close()


def test_says_what_to_pass_when_the_directory_holds_no_ledger(tmp_path):
    proc = _hang_report(str(tmp_path))
    assert proc.returncode == 2 and "no rank<N>.json" in proc.stderr
    proc = _hang_report(str(tmp_path / "missing"))
    assert proc.returncode == 2 and "not a directory" in proc.stderr
