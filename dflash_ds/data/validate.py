"""Cheap checks of local JSON / JSON Lines data files, run before `datasets` parses them.

`datasets` reports an empty file as StopIteration, bad bytes as a bare UnicodeDecodeError and one
malformed line somewhere in a large file as a pyarrow error without a line number. Reading the
file once here names the file and line instead. Only files that `prepare` actually loads are read
(a cache hit reads nothing), so a second launch of the same run pays nothing.
"""

from __future__ import annotations

import json
from pathlib import Path


class DataFileError(ValueError):
    """A data file that cannot be read as chat data; the message names the setting, file and line."""


def check_json_file(path: Path, setting: str) -> int:
    """Raise DataFileError for the first problem in `path`; returns the number of records."""
    raw = path.read_bytes()
    if not raw.strip():
        raise DataFileError(f"{setting}: {path} is empty; point {setting} at a file with one conversation per line")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataFileError(f"{setting}: {path}:{line}: bytes that are not UTF-8 (0x{raw[exc.start]:02x} at column "
                            f"{col}); re-encode the file as UTF-8") from None
    text = text.lstrip("\ufeff")
    if path.suffix.lower() == ".json" and text.lstrip()[:1] == "[":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFileError(f"{setting}: {path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno})") from None
        bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataFileError(f"{setting}: {path}: item {bad} of the JSON list is not an object")
        if not records:
            raise DataFileError(f"{setting}: {path} is an empty JSON list")
        return len(records)
    count = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataFileError(f"{setting}: {path}:{lineno}: not valid JSON ({exc.msg}, column {exc.colno}); fix or "
                                "remove that line") from None
        if not isinstance(record, dict):
            raise DataFileError(f"{setting}: {path}:{lineno}: expected a JSON object per line, got "
                                f"{type(record).__name__}")
        count += 1
    return count


def check_local(files: list[Path], setting: str) -> None:
    """Check every JSON / JSON Lines file among `files` record by record, and that every Parquet or
    Arrow file is one (its footer read): a damaged file is named, not the directory it is in."""
    for f in files:
        suffix = f.suffix.lower()
        if suffix in (".json", ".jsonl"):
            check_json_file(f, setting)
        elif suffix in (".parquet", ".arrow") and f.stat().st_size == 0:
            raise ValueError(f"{setting}: {f} is empty (0 bytes), not a {suffix[1:]} file; write it again or remove it")
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                pq.read_metadata(f)
            except Exception as exc:  # noqa: BLE001  pyarrow's ArrowInvalid / OSError: the file is not whole
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ValueError(f"{setting}: {f} is not a readable Parquet file ({first}); write it again or "
                                 "remove it") from None


def record_format(fields) -> str:
    """The chat format a record's (or a table's) fields hold: messages, conversations, prompt_response,
    or `other`."""
    present = {k for k in fields}
    for name in ("messages", "conversations"):
        if name in present:
            return name
    return "prompt_response" if {"prompt", "response"} <= present else "other"


def format_counts(files: list[Path]) -> dict[str, int]:
    """Records per chat format over local JSON / JSON Lines / Parquet files (Arrow files are not read)."""
    counts: dict[str, int] = {}
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            meta = pq.read_metadata(f)
            kind = record_format(meta.schema.to_arrow_schema().names)
            counts[kind] = counts.get(kind, 0) + meta.num_rows
        elif suffix in (".json", ".jsonl"):
            text = f.read_text(encoding="utf-8", errors="replace").lstrip("\ufeff")
            if suffix == ".json" and text.lstrip()[:1] == "[":
                records = json.loads(text)
            else:
                records = (json.loads(line) for line in text.splitlines() if line.strip())
            for r in records:
                kind = record_format({k for k, v in r.items() if v is not None} if isinstance(r, dict) else ())
                counts[kind] = counts.get(kind, 0) + 1
    return counts
