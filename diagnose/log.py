"""Metrics logs: write JSONL rows; read JSONL, CSV or TensorBoard scalars back as a history (list of rows).

The JSONL format (see docs/diagnose.md): one JSON object per line, one line per training step, keys are metric
names (``rlguard.diagnose.metrics.METRICS``), values are numbers. ``step`` orders the rows (its line index
when absent). A key may be missing from some rows (``eval_pass`` is logged every few steps). Non-finite values
are written as ``NaN`` / ``Infinity`` (Python's and pandas' JSON convention). Blank lines are skipped.
"""

from __future__ import annotations

import csv
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO


class HistoryError(ValueError):
    """A metrics log that cannot be read; ``path`` and ``line`` (1-based, or None) say where."""

    def __init__(self, path: str | os.PathLike, message: str, line: int | None = None):
        self.path, self.line, self.message = str(path), line, message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


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


def _number(path, line, key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HistoryError(path, f"value of {key!r} is {value!r}, not a number", line)
    return value


def _order(rows: list[dict]) -> list[dict]:
    for i, row in enumerate(rows):
        row.setdefault("step", i)
    return sorted(rows, key=lambda r: r["step"])


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise HistoryError(path, f"not valid JSON ({exc.msg}, column {exc.colno})", number) from None
            if not isinstance(obj, dict):
                raise HistoryError(path, f"expected a JSON object per line, got {type(obj).__name__}", number)
            row = {}
            for key, value in obj.items():
                if value is None or isinstance(value, str):
                    continue  # a metric not measured at this step, or a label: not a number to read
                row[key] = _number(path, number, key, value)
            rows.append(row)
    return _order(rows)


def read_csv(path: str | os.PathLike) -> list[dict]:
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
    return _order(rows)


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


def read_tensorboard(path: str | os.PathLike) -> list[dict]:
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
    return _rows_from_scalars(scalars)


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


def read_history(path: str | os.PathLike) -> list[dict]:
    """A metrics log -> rows ordered by step. ``.jsonl``/``.json``/``.ndjson`` (JSON lines), ``.csv``, or a
    TensorBoard event file or log directory. Raises ``HistoryError`` naming the file (and line) on bad input."""
    p = Path(path)
    if not p.exists():
        raise HistoryError(path, "no such file or directory")
    if p.is_dir() or "tfevents" in p.name:
        return read_tensorboard(p)
    try:
        if p.suffix.lower() == ".csv":
            return read_csv(p)
        return read_jsonl(p)
    except UnicodeDecodeError:
        raise HistoryError(path, "not a text file (expected JSON lines or CSV)") from None
    except OSError as exc:
        raise HistoryError(path, exc.strerror or str(exc)) from None
