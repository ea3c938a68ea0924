"""Rows of a prompt file, read without torch: the data source loads them, parse_args checks them before Ray starts.

A prompt file is JSONL (one JSON object per line; blank lines are skipped) or parquet (one row per record, read
with pyarrow; "line" numbers are row numbers from 1).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def read_rows(path: str | None, flag: str) -> Iterator[tuple[int, dict]]:
    """(line number, row dict) of a JSONL (or parquet) prompt file; `flag` names it in errors."""
    file = Path(path or "")
    if not path or not file.is_file():
        raise FileNotFoundError(f"{flag}: prompt file {path!r} does not exist")
    if file.suffix == ".parquet":
        yield from _read_parquet(path, flag)
        return
    with file.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{flag}: {file}:{lineno}: malformed JSON line ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{flag}: {file}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def _read_parquet(path: str, flag: str) -> Iterator[tuple[int, dict]]:
    """Rows as plain Python values (list columns as lists, image structs as dicts), numbered from 1. An empty
    file has no rows, as an empty JSONL file."""
    import pyarrow.parquet as pq

    if Path(path).stat().st_size == 0:
        return
    try:
        batches = pq.ParquetFile(path).iter_batches()
        row_number = 0
        for batch in batches:
            for row in batch.to_pylist():
                row_number += 1
                yield row_number, row
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{flag}: {path} cannot be read as parquet ({exc})") from None


def missing_key_message(flag: str, where: str, row: dict, key: str, key_flag: str) -> str:
    """'--prompt-data: FILE:LINE: input key 'x' missing (keys: [...]); set --input-key'."""
    what = key_flag.removeprefix("--").replace("-", " ")
    return f"{flag}: {where}: {what} {key!r} missing (keys: {sorted(row)}); set {key_flag}"


def check_prompt_rows(path: str, flag: str, input_key: str, label_key: str | None) -> None:
    """Every row of a JSONL or parquet prompt file holds `input_key` (and `label_key` when set); raises
    ValueError naming the first bad line (a parquet file's row number)."""
    for lineno, row in read_rows(path, flag):
        for key, key_flag in ((input_key, "--input-key"), (label_key, "--label-key")):
            if key is not None and key not in row:
                raise ValueError(missing_key_message(flag, f"{path}:{lineno}", row, key, key_flag))
