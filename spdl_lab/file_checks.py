"""What every spdl_lab JSON file shares: a strict checker, a safe reader, an atomic writer.

Reading executes nothing: a file becomes dicts, lists, numbers and strings only, and
the format modules (``diagnose.file_format``, ``experiments.comparison_file``) check every field with a
``Checker`` whose errors name the file, the JSON path and what was expected.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from .errors import FileFormatError

__all__ = ["Checker", "dump_document", "load_document"]

MAX_NAME, MAX_TEXT = 200, 100_000  # characters: names and short labels; evidence, tracebacks
MAX_META_KEYS, MAX_META_LIST = 200, 10_000
MAX_COUNT = 10**15


class Checker:
    """Type and range checks that name the file, the JSON path and what was expected.

    A format subclasses it to set ``noun`` ("diagnosis"), the advice its
    messages end with, and the exception class it raises.
    """

    noun: ClassVar[str] = "spdl_lab"
    read_fix: ClassVar[str] = "Only files written by spdl_lab can be read"
    write_fix: ClassVar[str] = "Correct that field"
    error: ClassVar[type[FileFormatError]] = FileFormatError

    def __init__(self, source: Path | str, writing: bool) -> None:
        self.source, self.writing = str(source), writing

    def fail(self, where: str, problem: str, fix: str | None = None) -> FileFormatError:
        head = f"cannot write {self.noun} {self.source}" if self.writing else f"{self.noun} file {self.source}"
        fix = fix or (self.write_fix if self.writing else self.read_fix)
        at = f" {where}:" if where else ""
        return self.error(f"{head}:{at} {problem}. {fix}.", source=self.source, field=where)

    def expected(self, where: str, what: str, value: Any) -> FileFormatError:
        return self.fail(where, f"expected {what}, got {describe(value)}")

    def record(self, value: Any, where: str, spec: dict[str, Callable]) -> dict[str, Any]:
        """An object with exactly the keys of ``spec``, each checked by its function."""
        if not isinstance(value, dict):
            raise self.expected(where, "an object", value)
        extra = [k for k in value if k not in spec]
        if extra:
            raise self.fail(f"{where}.{key_path(extra[0])}".lstrip("."), f"unknown key (allowed: {', '.join(spec)})")
        missing = [k for k in spec if k not in value]
        if missing:
            raise self.fail(f"{where}.{missing[0]}".lstrip("."), "key is missing")
        return {k: check(self, value[k], f"{where}.{k}".lstrip(".")) for k, check in spec.items()}

    def array(self, value: Any, where: str, limit: int, what: str = "items") -> list:
        if not isinstance(value, list):
            raise self.expected(where, "an array", value)
        if len(value) > limit:
            raise self.fail(where, f"{len(value)} {what}, more than the limit of {limit}")
        return value

    def integer(self, value: Any, where: str, lo: int, hi: int, null: bool = False) -> int | None:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.expected(where, f"an integer in {lo}..{hi}" + (" or null" if null else ""), value)
        return value

    def number(self, value: Any, where: str, lo: float, hi: float) -> float:
        # null stands for NaN: JSON has no NaN, and the writers write NaN and inf as null.
        if value is None:
            return math.nan
        what = f"a number >= {lo:g} or null" if hi == math.inf else f"a number in {lo:g}..{hi:g} or null"
        if lo == -math.inf and hi == math.inf:
            what = "a finite number or null"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.expected(where, what, value)
        if isinstance(value, int) and not -1e300 < value < 1e300:  # float() of 10**400 overflows
            raise self.expected(where, what, value)
        if not (math.isfinite(value) and lo <= value <= hi):
            raise self.expected(where, what, value)
        return float(value)

    def text(self, value: Any, where: str, limit: int, choices: tuple | None = None,
             null: bool = False) -> str | None:
        if value is None and null:
            return None
        if not isinstance(value, str):
            raise self.expected(where, "a string" + (" or null" if null else ""), value)
        if choices is not None and value not in choices:
            raise self.expected(where, "one of " + ", ".join(map(repr, choices)), value)
        if len(value) > limit:
            raise self.fail(where, f"string of {len(value)} characters is longer than the limit of {limit}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: it would break every writer downstream
            raise self.fail(where, "string holds an unpaired surrogate (not valid Unicode)") from None
        return value

    def meta(self, value: Any, where: str) -> dict[str, Any]:
        """settings / machine: a flat dict of str to a scalar or a flat list of scalars."""
        if not isinstance(value, dict):
            raise self.expected(where, "an object", value)
        if len(value) > MAX_META_KEYS:
            raise self.fail(where, f"{len(value)} keys, more than the limit of {MAX_META_KEYS}")
        out = {}
        for key, item in value.items():
            self.text(key, f"{where} key", MAX_NAME)
            at = f"{where}[{short(key)}]"
            if isinstance(item, (list, tuple)):
                if len(item) > MAX_META_LIST:
                    raise self.fail(at, f"list of {len(item)} items, more than the limit of {MAX_META_LIST}")
                out[key] = [self._scalar(x, f"{at}[{i}]") for i, x in enumerate(item)]
            else:
                out[key] = self._scalar(item, at)
        return out

    def _scalar(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return self.text(value, where, MAX_TEXT)
        if isinstance(value, numbers.Integral):
            return self.integer(int(value), where, -(2**63), 2**63 - 1)
        if isinstance(value, numbers.Real):
            value = float(value)
            if self.writing and not math.isfinite(value):
                return None
            return self.number(value, where, -math.inf, math.inf)
        raise self.expected(where, "a string, number, bool, null or a flat list of those", value)


def describe(value: Any) -> str:
    """A value named for an error message, never longer than a line."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an int of {value.bit_length()} bits"
    kind = {dict: "object", list: "array", str: "string", bool: "bool", type(None): "null"}.get(
        type(value), type(value).__name__)
    return f"{kind} {short(value)}" if kind not in ("object", "array") else kind


def short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def key_path(key: str) -> str:
    return key if key.isidentifier() and len(key) <= 60 else f"[{short(key)}]"


# Field checks for Checker.record specs: each takes (checker, value, where).
def text_field(limit: int, choices: tuple | None = None, null: bool = False) -> Callable:
    return lambda c, v, w: c.text(v, w, limit, choices, null)


def int_field(lo: int, hi: int, null: bool = False) -> Callable:
    return lambda c, v, w: c.integer(v, w, lo, hi, null)


def num_field(lo: float, hi: float = math.inf) -> Callable:
    return lambda c, v, w: c.number(v, w, lo, hi)


def later(checker: Checker, value: Any, where: str) -> Any:
    """A field checked after the record, by code that needs the record's other fields."""
    return value


def plain(value: Any) -> Any:
    """A value as JSON takes it: NaN and inf become null (JSON has neither), numpy numbers plain."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if math.isfinite(value) else None


def check_header(doc: dict[str, Any], checker: Checker, fmt: str, version: int,
                 older: tuple[int, ...] = ()) -> int:
    """``format`` first, then ``version`` (``version`` or one of the ``older`` ones still
    read), each with its own message; returns the version found."""
    if doc.get("format") != fmt:
        raise checker.expected("format", repr(fmt), doc.get("format"))
    found = doc.get("version")
    accepted = (*older, version)
    if type(found) is not int or found not in accepted:  # True == 1 and 1.0 == 1 must not pass
        fix = "Upgrade spdl_lab to read it" if type(found) is int and found > version else None
        expected = " or ".join(map(str, accepted))
        raise checker.fail("version", f"expected {expected}, got {describe(found)}", fix)
    return found


def dump_document(doc: dict[str, Any], path: Path, *, compact: bool = False) -> Path:
    """Write ``doc`` as JSON to ``path`` atomically: a reader never sees half a file.

    ``compact`` writes one line without spaces, for documents of long number arrays.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            if compact:
                json.dump(doc, f, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
            else:
                json.dump(doc, f, allow_nan=False, ensure_ascii=False, indent=1)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (NaN and infinities are written as null)")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {short(dup)} appears twice in one object")
    return out


def load_document(path: Path, checker: Checker, max_bytes: int) -> dict[str, Any]:
    """Parse ``path`` (at most ``max_bytes``) into a JSON object, or raise the checker's error.

    No NaN or Infinity literals, no key twice in one object, no nesting deep
    enough to exhaust the stack. A missing file raises the usual OSError.
    """
    size = path.stat().st_size
    if size > max_bytes:
        raise checker.fail("", f"{size} bytes, larger than the limit of {max_bytes}")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)  # the file may have grown since stat
    if len(data) > max_bytes:
        raise checker.fail("", f"larger than the limit of {max_bytes} bytes")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constants,
                         object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise checker.fail("", f"nested too deeply to be a {checker.noun}") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, digit limit, our hooks
        raise checker.fail("", f"not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise checker.expected("top level", "an object", doc)
    return doc
