"""Metrics logs: write JSONL rows; read JSONL, CSV, TensorBoard scalars or TRL's logs back as a history (rows).

The JSONL format (see docs/diagnose.md): one JSON object per line, one line per training step, keys are metric
names (``rlguard.diagnose.metrics.METRICS``), values are numbers. ``step`` orders the rows (its line index
when absent). A key may be missing from some rows (``eval_pass`` is logged every few steps). Non-finite values
are written as ``NaN`` / ``Infinity`` (Python's and pandas' JSON convention). Blank lines are skipped.

TRL's logs read too (``rlguard.diagnose.trl_logs``): a ``trainer_state.json``, its ``log_history`` list alone, or
JSON lines of TRL's ``on_log`` dicts; their training rows are read under rlguard's names.
"""

from __future__ import annotations

import csv
import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from rlguard.diagnose import trl_logs


class HistoryError(ValueError):
    """A metrics log that cannot be read; ``path`` and ``line`` (1-based, or None) say where."""

    def __init__(self, path: str | os.PathLike, message: str, line: int | None = None):
        self.path, self.line, self.message = str(path), line, message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class History(list):
    """Rows ordered by step (a list of dicts, as before), and what the reader learned about the log.

    ``source``: "trl" for TRL's logs, else the format read ("jsonl", "csv", "tensorboard"). ``nulls``: metric ->
    the steps whose row holds it as null (not measured there; TRL logs a metric that is NaN at every step of a
    logging interval as null). ``renamed``: rlguard name -> the log's own name, where the reader mapped one (TRL's
    ``kl`` -> ``kl_ref``). ``missing_reasons``: metric -> why this kind of log lacks it, for the report's list of
    the rules that are off.
    """

    def __init__(self, rows=(), source: str | None = None, nulls: Mapping[str, list[int]] | None = None,
                 renamed: Mapping[str, str] | None = None, missing_reasons: Mapping[str, str] | None = None):
        super().__init__(rows)
        self.source = source
        self.nulls = dict(nulls or {})
        self.renamed = dict(renamed or {})
        self.missing_reasons = dict(missing_reasons or {})


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors and numpy scalars become Python numbers."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    raise TypeError(f"metric value {value!r} is not a number")


class MetricsLogger:
    """Append one JSON line per step to ``path`` and flush it, so a crashed or running job's log reads.

    >>> with MetricsLogger("run.jsonl") as log:          # doctest: +SKIP
    ...     log.log({"step": 0, "reward": 0.2})
    """

    def __init__(self, path: str | os.PathLike, mode: str = "w"):
        if mode not in ("w", "a"):
            raise ValueError("mode is 'w' (new log) or 'a' (append)")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(self.path, mode, encoding="utf-8")
        self.rows = 0

    def log(self, row: Mapping[str, Any]) -> None:
        if self._file is None:
            raise ValueError("MetricsLogger is closed")
        plain = {str(k): _plain(v) for k, v in row.items()}
        self._file.write(json.dumps(plain, allow_nan=True) + "\n")
        self._file.flush()
        self.rows += 1

    __call__ = log  # so a logger can be passed as a trainer's on_step callback

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _number(path, line, key, value, where: str = ""):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HistoryError(path, f"{where}value of {key!r} is {value!r}, not a number", line)
    return value


def _order(rows: list[dict]) -> list[dict]:
    for i, row in enumerate(rows):
        row.setdefault("step", i)
    return sorted(rows, key=lambda r: r["step"])


def _metric_row(path, line: int | None, obj: Mapping[str, Any], where: str = "",
                line_of_key: Callable[[str], int] | None = None) -> tuple[dict, list[str]]:
    """(numeric values, keys that are null) of one JSON row; strings (labels) are not metrics and are skipped.
    A value that is not a number is an error at ``line``, or at ``line_of_key(key)`` for a row spanning lines."""
    row, nulls = {}, []
    for key, value in obj.items():
        if value is None:
            nulls.append(key)  # a metric not measured at this step
        elif not isinstance(value, str):
            row[key] = _number(path, line_of_key(key) if line_of_key else line, key, value, where)
    return row, nulls


def _history(parsed: list[tuple[dict, list[str]]], source: str, renamed: Mapping[str, str] | None = None,
             missing_reasons: Mapping[str, str] | None = None) -> History:
    """Rows with their null keys -> a History ordered by step, the nulls by the step they belong to."""
    rows = _order([row for row, _ in parsed])  # assigns the line index as step where a row has none
    nulls: dict[str, list[int]] = {}
    for row, null_keys in parsed:
        for key in null_keys:
            nulls.setdefault(key, []).append(row["step"])
    return History(rows, source, {k: sorted(v) for k, v in nulls.items()}, renamed, missing_reasons)


def _jsonl_objects(path, text: str) -> list[tuple[int, dict]]:
    objects = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HistoryError(path, f"not valid JSON ({exc.msg}, column {exc.colno})", number) from None
        if not isinstance(obj, dict):
            raise HistoryError(path, f"expected a JSON object per line, got {type(obj).__name__}", number)
        objects.append((number, obj))
    return objects


def _trl_history(path, entries: list[tuple[int, str, dict, Callable[[str], int] | None]]) -> History:
    """TRL's log rows (line, where, dict, line of a key) -> their training rows under rlguard's names. Evaluation
    rows and the end-of-training summary are skipped (the metrics TRL flushes into the summary, of the steps after
    the last logging step, are not read: the summary has no loss or grad_norm, which would read as metrics that
    stop)."""
    parsed, renamed = [], {}
    for line, where, entry, line_of_key in entries:
        if not trl_logs.is_training_row(entry):
            continue
        values, null_keys = _metric_row(path, line, entry, where, line_of_key)  # errors name TRL's own keys
        mapped, names = trl_logs.rlguard_names({**values, **dict.fromkeys(null_keys)})
        parsed.append(({k: v for k, v in mapped.items() if v is not None},
                       [k for k, v in mapped.items() if v is None]))
        renamed.update(names)
    if entries and not parsed:
        raise HistoryError(path, f"no training rows among TRL's {len(entries)} log entries (only evaluation rows "
                                 "or the end-of-training summary)")
    return _history(parsed, "trl", renamed, trl_logs.TRL_NOT_LOGGED)


def read_jsonl(path: str | os.PathLike, text: str | None = None) -> History:
    """JSON lines: rlguard's rows, or TRL's ``on_log`` dicts (read as TRL's when a row has a TRL-only name)."""
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    objects = _jsonl_objects(path, text)
    if any(trl_logs.is_trl_row(obj) for _, obj in objects):
        return _trl_history(path, [(number, "", obj, None) for number, obj in objects])
    return _history([_metric_row(path, number, obj) for number, obj in objects], "jsonl")


# --- TRL's trainer_state.json, or its log_history list -----------------------------------------------------------

_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _array_items(text: str, i: int):
    """(offset, value) of each item of the JSON array at ``text[i]``, in a text already known to be valid JSON."""
    i = _skip_space(text, i + 1)
    while text[i] != "]":
        value, end = _DECODER.raw_decode(text, i)
        yield i, value
        i = _skip_space(text, end)
        i = _skip_space(text, i + 1) if text[i] == "," else i


def _object_members(text: str, i: int):
    """(key, offset of its value, value) of each member of the JSON object at ``text[i]`` (valid JSON)."""
    i = _skip_space(text, i + 1)
    while text[i] != "}":
        key, end = _DECODER.raw_decode(text, i)
        i = _skip_space(text, _skip_space(text, end) + 1)  # past the colon
        value, end = _DECODER.raw_decode(text, i)
        yield key, i, value
        i = _skip_space(text, end)
        i = _skip_space(text, i + 1) if text[i] == "," else i


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def read_trl_state(path: str | os.PathLike, text: str | None = None) -> History:
    """A ``trainer_state.json`` (a JSON object with a ``log_history`` list) or its ``log_history`` list alone ->
    the training rows, TRL's names mapped to rlguard's. Errors name the file and the line of the bad entry."""
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HistoryError(path, f"not valid JSON ({exc.msg}, column {exc.colno})", exc.lineno) from None
    start = _skip_space(text, 0)
    if isinstance(document, dict):
        found = [(offset, value) for key, offset, value in _object_members(text, start) if key == "log_history"]
        if not found:
            raise HistoryError(path, "a JSON object without \"log_history\": expected a trainer_state.json "
                                     "(transformers, TRL), its log_history list, or JSON lines of metric rows",
                               _line_of(text, start))
        start, document = found[-1]  # json.loads keeps the last of repeated keys too
        if not isinstance(document, list):
            raise HistoryError(path, f"\"log_history\" is a JSON {_json_type(document)}, not a list of log entries",
                               _line_of(text, start))
        label = "log_history"
    elif isinstance(document, list):
        label = "entry "
    else:
        raise HistoryError(path, f"expected a JSON object (a trainer_state.json) or a list (its log_history), got "
                                 f"a JSON {_json_type(document)}", _line_of(text, start))
    entries = []
    for index, (offset, entry) in enumerate(_array_items(text, start)):
        where = f"{label}[{index}]" if label == "log_history" else f"{label}{index}"
        if not isinstance(entry, dict):
            raise HistoryError(path, f"{where} is a JSON {_json_type(entry)}, not an object of metrics",
                               _line_of(text, offset))
        entries.append((_line_of(text, offset), f"{where}: ", entry, _key_lines(text, offset)))
    return _trl_history(path, entries)


def _key_lines(text: str, offset: int) -> Callable[[str], int]:
    """key -> the line of its value in the JSON object at ``text[offset]`` (looked up only for an error)."""
    def line_of_key(key: str) -> int:
        found = offset
        for member, at, _ in _object_members(text, offset):
            if member == key:
                found = at  # the last of repeated keys, the one json.loads keeps
        return _line_of(text, found)
    return line_of_key


def _json_type(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def _is_json_document(text: str) -> bool:
    """Whether a JSON file is one document (a trainer_state.json, a log_history list) rather than JSON lines: it
    opens with an array (a row is an object), its first line is "{" alone (json.dumps(indent=...), as
    transformers saves trainer_state.json), its first line is a whole trainer_state, or its first line is not a
    whole row and the whole text is one valid document. A bad row stays a JSON-lines error naming its line."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        return True
    if not stripped.startswith("{"):
        return False
    first = stripped.split("\n", 1)[0].strip()
    if first == "{":
        return True
    try:
        obj = json.loads(first)
    except json.JSONDecodeError:
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return False
        return True
    return isinstance(obj, dict) and "log_history" in obj


def read_csv(path: str | os.PathLike) -> History:
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            raise HistoryError(path, "empty CSV: no header row", 1)
        for row_dict in reader:
            number = reader.line_num
            row = {}
            for key, text in row_dict.items():
                if key is None:
                    raise HistoryError(path, "more cells than header columns", number)
                if text is None or not text.strip():
                    continue
                try:
                    row[key] = float(text)
                except ValueError:
                    raise HistoryError(path, f"value of {key!r} is {text!r}, not a number", number) from None
            if "step" in row:
                row["step"] = int(row["step"])
            rows.append(row)
    return History(_order(rows), "csv")


def _tag_name(tag: str) -> str:
    """``train/reward`` -> ``reward``: the metric name is the last path component of a tag."""
    return tag.rsplit("/", 1)[-1]


def _rows_from_scalars(scalars: dict[str, dict[int, float]]) -> list[dict]:
    by_step: dict[int, dict] = {}
    for tag, points in scalars.items():
        for step, value in points.items():
            by_step.setdefault(step, {"step": step})[_tag_name(tag)] = value
    return [by_step[s] for s in sorted(by_step)]


def _event_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and "tfevents" in p.name)


def read_tensorboard(path: str | os.PathLike) -> History:
    """Scalars of a TensorBoard log (an event file or a directory of them) -> rows keyed by step.

    Uses the ``tensorboard`` package when it is installed; otherwise a small built-in reader of the event
    file format (TFRecord framing, scalar summaries as ``simple_value`` or a float/double tensor).
    """
    p = Path(path)
    files = _event_files(p)
    if not files:
        raise HistoryError(path, "no TensorBoard event files (*tfevents*) found")
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415
    except ImportError:
        EventAccumulator = None
    scalars: dict[str, dict[int, float]] = {}
    for file in files:
        if EventAccumulator is not None:
            acc = EventAccumulator(str(file), size_guidance={"scalars": 0, "tensors": 0})
            acc.Reload()
            for tag in acc.Tags().get("scalars", []):
                for event in acc.Scalars(tag):
                    scalars.setdefault(tag, {})[event.step] = float(event.value)
            for tag in acc.Tags().get("tensors", []):
                for event in acc.Tensors(tag):
                    value = _tensor_proto_scalar(event.tensor_proto)
                    if value is not None:
                        scalars.setdefault(tag, {})[event.step] = value
        else:
            for tag, step, value in _iter_event_scalars(file):
                scalars.setdefault(tag, {})[step] = value
    return History(_rows_from_scalars(scalars), "tensorboard")


def _tensor_proto_scalar(proto) -> float | None:
    if proto.float_val:
        return float(proto.float_val[0])
    if proto.double_val:
        return float(proto.double_val[0])
    return None


# --- a minimal event-file reader, used when the tensorboard package is not installed -------------------------

def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message; length-delimited values are bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


def _tensor_value(buf: bytes) -> float | None:
    """A scalar from a TensorProto: dtype 1 = float, 2 = double; float_val (5), double_val (6), content (4)."""
    dtype, content, value = 0, b"", None
    for field, wire, v in _fields(buf):
        if field == 1 and wire == 0:
            dtype = v
        elif field == 4 and wire == 2:
            content = v
        elif field == 5:
            value = struct.unpack("<f", v if wire == 5 else v[:4])[0]
        elif field == 6:
            value = struct.unpack("<d", v if wire == 1 else v[:8])[0]
    if value is None and content:
        if dtype == 1 and len(content) >= 4:
            value = struct.unpack("<f", content[:4])[0]
        elif dtype == 2 and len(content) >= 8:
            value = struct.unpack("<d", content[:8])[0]
    return value


def _iter_event_scalars(path: Path):
    """(tag, step, value) of each scalar in one event file (Event: step = 2, summary = 5; Value: tag = 1,
    simple_value = 2, tensor = 8)."""
    data = path.read_bytes()
    i = 0
    while i + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[i:i + 8])
        start = i + 12  # 8 bytes length, 4 bytes its CRC
        record = data[start:start + length]
        if len(record) < length:
            raise HistoryError(path, "truncated event record")
        i = start + length + 4  # record and its CRC
        step, summary = 0, None
        for field, wire, v in _fields(record):
            if field == 2 and wire == 0:
                step = v
            elif field == 5 and wire == 2:
                summary = v
        if summary is None:
            continue
        for field, wire, value_msg in _fields(summary):
            if field != 1 or wire != 2:
                continue
            tag, value = None, None
            for f, w, v in _fields(value_msg):
                if f == 1 and w == 2:
                    tag = v.decode("utf-8", "replace")
                elif f == 2 and w == 5:
                    value = struct.unpack("<f", v)[0]
                elif f == 8 and w == 2:
                    value = _tensor_value(v)
            if tag is not None and value is not None:
                yield tag, int(step), float(value)


def read_history(path: str | os.PathLike) -> History:
    """A metrics log -> rows ordered by step: JSON lines (``.jsonl``/``.json``/``.ndjson``; rlguard's rows or TRL's
    ``on_log`` dicts), a TRL ``trainer_state.json`` or its ``log_history`` list, ``.csv``, or a TensorBoard event
    file or log directory. Raises ``HistoryError`` naming the file (and line) on bad input."""
    p = Path(path)
    if not p.exists():
        raise HistoryError(path, "no such file or directory")
    if p.is_dir() or "tfevents" in p.name:
        return read_tensorboard(p)
    try:
        if p.suffix.lower() == ".csv":
            return read_csv(p)
        text = p.read_text(encoding="utf-8")
        if _is_json_document(text):
            return read_trl_state(p, text)
        return read_jsonl(p, text)
    except UnicodeDecodeError:
        raise HistoryError(path, "not a text file (expected JSON lines, a trainer_state.json or CSV)") from None
    except OSError as exc:
        raise HistoryError(path, exc.strerror or str(exc)) from None
    except RecursionError:
        raise HistoryError(path, "JSON nested too deeply to read") from None
