"""Strict JSON for every file the lab writes and message it sends: NaN as null, numpy numbers as
Python's, atomic files; reading refuses NaN literals and repeated keys."""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Any

_AS_IS = (str, int, bool, type(None))


def plain(value: Any) -> Any:
    """``value`` as JSON takes it: tuples and arrays as lists, NaN and inf as null, numpy
    numbers as Python's; anything else as it is, for the reader's schema to refuse."""
    if type(value) is float:  # first: long arrays of numbers are most of a big file
        return value if math.isfinite(value) else None
    if type(value) in _AS_IS:
        return value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays and scalars
        return plain(value.tolist())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if math.isfinite(value) else None


def dumps(value: Any, *, compact: bool = True) -> str:
    """``value`` as strict JSON text (``plain`` first); ``compact`` writes one line."""
    spacing: dict[str, Any] = {"separators": (",", ":")} if compact else {"indent": 1}
    return json.dumps(plain(value), allow_nan=False, ensure_ascii=False, **spacing)


def dump_file(value: Any, path: str | os.PathLike, *, compact: bool = False) -> Path:
    """Write ``value`` as JSON to ``path`` atomically; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, dumps(value, compact=compact).encode("utf-8"))
    return path


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader (another process) ever sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (a missing number is written as null)")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {dup[:60]!r} appears twice in one object")
    return out


def loads(data: str | bytes) -> Any:
    """Parse strict JSON; else ValueError with the reason (not UTF-8, NaN/Infinity, a key twice in
    one object, nesting too deep)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
