"""Loading dataset rows from files, folders, Python lists and `datasets` objects.

Rows are plain dicts in a list (our datasets fit in memory). The list is a `Rows`, which
remembers where each row came from, so validation errors can say `train.jsonl:17` or
`train.parquet: row 17`. Accepted sources:

- a path to `.jsonl`, `.json` (an array of objects, or JSON Lines), `.parquet` or `.csv`;
- a folder written by `datasets.Dataset.save_to_disk` (or a `DatasetDict`'s, where
  `split_name` picks the split, "train" by default);
- a glob pattern (`data/*.jsonl`) or a list of paths, concatenated in order;
- a Python list of dicts, a `datasets.Dataset` or `datasets.DatasetDict`.

ShareGPT rows (`conversations` of {"from", "value"}) come out as `messages` rows
(`formats.chatml_row`), from files and datasets alike.
`describe_source` says what a source was (its files, or its type; its rows and `rows_sha256`),
for the config.yaml of a run given a dataset from Python.

Nothing is dropped silently: a bad line, an empty file or a missing file is an error that
names the file (and line). Only blank lines in JSON Lines are skipped.

CSV holds only text, so the format columns (text, prompt, completion, chosen, rejected)
are read as strings ("4" stays "4"), while other columns get types inferred as
`datasets.load_dataset("csv")` would (an `answer` of 42 becomes the int 42).
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.data.formats import DataFormatError, chatml_row, detect_format, validate_rows

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike
_CSV_STRING_COLUMNS = ("text", "prompt", "completion", "chosen", "rejected", "messages")
_JSON_TYPES = {
    dict: "object",
    list: "list",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
}


class Rows(list):
    """A list of row dicts that knows each row's origin, for error messages.

    `segments` holds `(start, name, line_numbers)` per source, in order: rows
    `start..` came from `name`, and `line_numbers` (JSON Lines only; else None) gives the
    file line of each. Reordering the list in place makes `locate` wrong, so shuffle a copy.
    """

    def __init__(
        self, rows: Sequence[dict] = (), name: str = "dataset", lines: list[int] | None = None
    ):
        super().__init__(rows)
        self.name = name
        self.segments: list[tuple[int, str, list[int] | None]] = [(0, name, lines)]

    @classmethod
    def concat(cls, parts: Sequence[Rows]) -> Rows:
        """Join several sources end to end, keeping every row's origin."""
        out = cls(name=" + ".join(p.name for p in parts))
        out.segments = []
        for part in parts:
            for start, name, lines in part.segments:
                out.segments.append((len(out) + start, name, lines))
            out.extend(part)
        return out

    def locate(self, i: int) -> str:
        """Where row `i` (0-based) came from: `path:LINE` for JSON Lines, else `path: row N`."""
        k = bisect.bisect_right([s[0] for s in self.segments], i) - 1
        start, name, lines = self.segments[max(k, 0)]
        if lines is not None and i - start < len(lines):
            return f"{name}:{lines[i - start]}"
        return f"{name}: row {i - start + 1}"


def _json_type(obj: Any) -> str:
    return "null" if obj is None else _JSON_TYPES.get(type(obj), type(obj).__name__)


def _read_jsonl(path: Path, name: str, text: str) -> Rows:
    rows, lines = [], []
    # Split on "\n" only: str.splitlines would also split inside strings holding U+2028 etc.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(
                f"{name}:{lineno}: {e.msg} (char {e.colno}); JSON Lines needs exactly one JSON "
                "object per line (is a record spread over several lines, or a stray comma?)"
            ) from None
        if not isinstance(obj, dict):
            raise DataFormatError(f"{name}:{lineno}: expected a JSON object, got {_json_type(obj)}")
        rows.append(obj)
        lines.append(lineno)
    return Rows(rows, name, lines)


def _read_json(path: Path, name: str, text: str) -> Rows:
    stripped = text.lstrip()
    if not stripped.startswith("["):
        if stripped.startswith("{") and "\n" in stripped.strip():
            try:
                whole = json.loads(text)
            except json.JSONDecodeError:
                whole = None  # several lines that are not one object: JSON Lines
            if isinstance(whole, dict):
                keys = ", ".join(map(str, whole)) or "none"
                raise DataFormatError(
                    f"{name}: expected a JSON array of row objects (or JSON Lines); found one "
                    f"object with keys {keys}; if the rows sit under one key, save that list"
                )
        return _read_jsonl(path, name, text)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{name}:{e.lineno}: {e.msg} (char {e.colno})") from None
    for i, obj in enumerate(data):
        if not isinstance(obj, dict):
            raise DataFormatError(
                f"{name}: row {i + 1}: expected a JSON object, got {_json_type(obj)}"
            )
    return Rows(data, name)


def _read_parquet(path: Path, name: str) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(f"{name}: not a readable Parquet file: {e}") from None
    return Rows(table.to_pylist(), name)


def _read_csv(path: Path, name: str) -> Rows:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    try:
        table = pcsv.read_csv(
            path,
            parse_options=pcsv.ParseOptions(newlines_in_values=True),
            convert_options=pcsv.ConvertOptions(
                column_types={c: pa.string() for c in _CSV_STRING_COLUMNS}
            ),
        )
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(f"{name}: cannot parse as CSV: {e}") from None
    return Rows(table.to_pylist(), name)


def _read_text_file(reader: Callable[[Path, str, str], Rows]) -> Callable[[Path, str], Rows]:
    def read(path: Path, name: str) -> Rows:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataFormatError(
                f"{name}: not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
        return reader(path, name, text)

    return read


READERS: dict[str, Callable[[Path, str], Rows]] = {
    ".jsonl": _read_text_file(_read_jsonl),
    ".json": _read_text_file(_read_json),
    ".parquet": _read_parquet,
    ".csv": _read_csv,
}
"""File readers by extension (lower case)."""


def _from_hf(ds: Any, name: str, split_name: str | None) -> Rows:
    """Rows of a `datasets.Dataset`, or of one split of a `DatasetDict`."""
    if isinstance(ds, Mapping):  # DatasetDict
        splits = ", ".join(ds) or "none"
        if split_name is None:
            if "train" not in ds:
                raise DataFormatError(
                    f"{name}: a DatasetDict with splits {splits} and no 'train'; "
                    "pass split_name= one of them"
                )
            if len(ds) > 1:
                logger.info(
                    "%s: a DatasetDict with splits %s; using 'train' (pass split_name to choose)",
                    name,
                    splits,
                )
            split_name = "train"
        elif split_name not in ds:
            raise DataFormatError(f"{name}: no split {split_name!r}; splits are {splits}")
        ds, name = ds[split_name], f"{name}[{split_name}]"
    return Rows(ds.to_list(), name)


def _load_path(path: Path, split_name: str | None) -> Rows:
    name = str(path)
    if path.is_dir():
        markers = ("dataset_info.json", "state.json", "dataset_dict.json")
        if not any((path / m).exists() for m in markers):
            raise DataFormatError(
                f"{name}: a folder, but not one written by datasets' save_to_disk (no "
                f"{' or '.join(markers)}); pass the data files themselves"
            )
        import datasets

        return _from_hf(datasets.load_from_disk(str(path)), name, split_name)
    if not path.exists():
        raise FileNotFoundError(f"{name}: no such file or folder")
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataFormatError(
            f"{name}: unsupported file type {path.suffix or '(no extension)'!r}; supported: "
            f"{', '.join(READERS)} files, or a folder saved by datasets' save_to_disk"
        )
    return reader(path, name)


def _expand(source: PathLike) -> list[Path]:
    text = os.fspath(source)
    if any(ch in text for ch in "*?[") and not Path(text).exists():
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise FileNotFoundError(f"{text}: the pattern matches no file")
        return [Path(m) for m in matches]
    return [Path(text)]


def load_rows(source: Any, *, split_name: str | None = None) -> Rows:
    """Load every row of `source` (see the module doc for what it may be) as dicts.

    Raises `FileNotFoundError` for a missing path and `DataFormatError` (a `ValueError`)
    for unreadable content or a source without rows, each naming the file and line.
    """
    if isinstance(source, Rows):
        parts = [source]
    elif isinstance(source, (str, os.PathLike)):
        parts = [_load_path(p, split_name) for p in _expand(source)]
    elif isinstance(source, (list, tuple)):
        if source and all(isinstance(s, (str, os.PathLike)) for s in source):
            parts = [_load_path(p, split_name) for s in source for p in _expand(s)]
        elif all(isinstance(r, Mapping) for r in source):
            parts = [Rows([dict(r) for r in source], "list")]
        else:
            kinds = sorted({type(s).__name__ for s in source})
            raise TypeError(
                f"a list source must hold only row dicts or only file paths; found {', '.join(kinds)}"
            )
    elif hasattr(source, "to_list") or (
        isinstance(source, Mapping)
        and source
        and all(hasattr(v, "to_list") for v in source.values())
    ):
        parts = [_from_hf(source, type(source).__name__, split_name)]
    else:
        raise TypeError(
            f"cannot load rows from a {type(source).__name__}; pass a path, a list of paths, "
            "a list of dicts or a datasets.Dataset"
        )
    for part in parts:
        if len(part) == 0:
            raise DataFormatError(f"{part.name}: no rows")
    return map_rows(parts[0] if len(parts) == 1 else Rows.concat(parts), chatml_row)


def map_rows(rows: Rows, fn: Callable[[dict], Any]) -> Rows:
    """`[fn(row) for row in rows]`, each row keeping its origin; a DataFormatError from `fn`
    names the row (`Rows.locate`). Rows `fn` returns unchanged are not copied."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(fn(row))
        except DataFormatError as e:
            raise DataFormatError(f"{rows.locate(i)}: {e}") from None
    if all(a is b for a, b in zip(out, rows)):
        return rows
    mapped = Rows(out, rows.name)
    mapped.segments = list(rows.segments)
    return mapped


def load_and_validate(
    source: Any, *, format: str | None = None, split_name: str | None = None
) -> tuple[Rows, str]:
    """Load `source`, detect its format (or take `format`), and validate every row.

    Returns the rows and the format name (see `posttrain.data.formats`).
    """
    return validate_loaded(load_rows(source, split_name=split_name), format)


def validate_loaded(rows: Rows, format: str | None = None) -> tuple[Rows, str]:
    """Detect the format of loaded `rows` (or take `format`) and validate every row."""
    if format is None:
        format = detect_format(rows[0].keys(), rows[0], first_source(rows))
        logger.info("%s: %d rows, detected format %r", rows.name, len(rows), format)
    validate_rows(rows, format, rows.name)
    return rows, format


def first_source(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The name of the file (or dataset) the first row came from, when `rows` knows it."""
    segments = getattr(rows, "segments", None)
    return segments[0][1] if segments else getattr(rows, "name", None)


def rows_sha256(rows: Sequence[Mapping[str, Any]]) -> str:
    """sha256 of the rows, one `json.dumps(row, sort_keys=True, ensure_ascii=False)` line each
    (non-JSON values as `str`): the same rows give the same digest, wherever they came from."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode() + b"\n")
    return digest.hexdigest()


def describe_source(source: Any) -> dict[str, Any]:
    """What a dataset source is, as config.yaml records one passed from Python:
    {"files": [absolute paths]} for files (globs expanded), else {"type": "list" |
    "datasets.Dataset" | ..., "hf_fingerprint": datasets' own, when it has one}; plus "rows"
    (how many) and "sha256" (`rows_sha256`). Loads the rows (`load_rows`)."""
    rows = load_rows(source)
    paths = [source] if isinstance(source, (str, os.PathLike)) else source
    if isinstance(paths, (list, tuple)) and paths and all(isinstance(p, (str, os.PathLike)) for p in paths):
        out: dict[str, Any] = {"files": [str(f.resolve()) for p in paths for f in _expand(p)]}
    else:
        kind = type(source)
        out = {"type": kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__name__}"}
        if getattr(source, "_fingerprint", None):
            out["hf_fingerprint"] = source._fingerprint
    return {**out, "rows": len(rows), "sha256": rows_sha256(rows)}
