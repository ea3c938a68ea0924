"""The repository speaks of the project alone: no words about how it was built.

A reader of the code, docs and results knows nothing of work sessions, of machines lent for a time,
of the tools that ran things, or of an internal issue tracker; hardware is named as what it is ("one
H200"), upstream's bugs by their public numbers ("upstream #1487").
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BANNED = {
    "a work-session number": r"\b[Ss]essions? \d",
    "an internal issue number (upstream's are written #N)": r"\b[Ii]ssues? \d",
    "machines lent for a time": r"\b(lent|withheld)\b",
    "the tool that ran a command": r"\bdevice (tool|calls?)\b",
    "a machine kind's name (say what the hardware is)": r"nvidia-h200",
    "carried files": r"\bcarr(y|ied|ying)\b[^\n]{0,12}\.whl",
    "who built it": r"\b(CEO|lead engineer|[Hh]elper [A-H])\b",
    "a numbered call of the tool that ran it (say 'run N' and give the command)": r"\b[Cc]alls? \d",
    "the time the hardware was held for": r"\b(device|GPU) time (was )?(spent|left|budget)|\bdevice time\b",
    "a limit of the tool that ran it": r"\b(per-)?call limit\b",
    "the machine's image (name the hardware and its software)": r"\b(device|GPU|machine's) image\b|\bthe image lacks\b",
    "upstream #1487's job called 'the seed' (a seed is a random seed; say 'upstream #1487's layout')":
        r"\b[Tt]he seed's\b|\bseed('s)? (layout|recording|configuration|config|flags|recipe|hang|symptom)\b"
        r"|(?<![A-Za-z])(SEED|seed)_(LAYOUT|RECORDING|FLAGS|layout|recording|configuration|recipe|run)(?![A-Za-z0-9])",
}
SELF = Path(__file__).resolve()


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = [ROOT / n for n in names]
    return [f for f in files if f.is_file() and f.resolve() != SELF and f.suffix not in (".png", ".whl", ".gz")]


def test_no_file_speaks_of_how_the_project_was_built():
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for what, pattern in BANNED.items():
            for match in re.finditer(pattern, text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}: {match.group(0)!r}")
    assert not found, "\n".join(found[:60]) + (f"\n... and {len(found) - 60} more" if len(found) > 60 else "")


def test_the_patterns_catch_what_they_name():
    samples = ["measured in session 3", "see issue 15", "2 GPUs were not lent", "one device call",
               "nvidia-h200-x2", "carry .whl/", "Helper C's engine", "call 3 (488 s)", "Calls 1 and 2",
               "the last 125 s of device time", "cut by the call limit", "the per-call limit",
               "no SGLang on the device image", "the image lacks Ray",
               "the seed's layout", "The seed's 8-GPU flags", "seed layout", "the seed layout's CPU runs",
               "seed recording", "the seed's flags", "SEED_LAYOUT", "def seed_recording(tmp_path_factory)",
               "test_seed_configuration_trains_every_rollout", "seed_run"]
    for sample in samples:
        assert any(re.search(p, sample) for p in BANNED.values()), sample
    for fine in ["upstream #1487", "a weight-update session", "one H200", "two H200s", "issue #2168", "run 3 (488 s)",
                 "calls `.tolist()` on the GPU", "a per-call cost", "device to device 2094 GB/s",
                 "the 600 s timeout", "--seed 1234", "a random seed", "the same seed", "sampling seed",
                 "sampling_seed", "seed_model_parallel(args)", "SEED_RANGE", "test_same_seed_same_weights",
                 "the seed, not the prompt, fixes the draws", "over three seeds", "ISSUE_LAYOUT"]:
        assert not any(re.search(p, fine) for p in BANNED.values()), fine


def test_the_coming_from_upstream_page_is_generated_from_the_registries():
    from slime.tools import upstream_notes

    assert upstream_notes.main(["--check"]) == 0, "run: python -m slime.tools.upstream_notes"
