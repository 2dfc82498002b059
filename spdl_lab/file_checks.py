"""What every saved result (a Diagnosis, a Comparison, a Tuning) shares: the types its fields are
checked as, and one strict reader and writer whose errors name the file, the JSON location and
what was expected.

A result's own dataclasses describe its file, and pydantic checks a file against them: no second
schema. Reading executes nothing: the file becomes plain data (``_json``), checked before use.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Generic, NoReturn, TypeVar

import pandas as pd
from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PlainValidator,
    Strict,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from typing_extensions import Self

from ._json import dump_file, loads, plain
from .errors import FileFormatError

__all__ = ["RECORD", "Count", "Flag", "Format", "Meta", "Name", "Rate", "Saved", "Share", "Text", "check", "describe",
           "integer", "load", "number", "read_any", "refuse", "rows", "string"]

MAX_NAME, MAX_TEXT = 200, 100_000  # characters: names and short labels; evidence, tracebacks
MAX_META_KEYS, MAX_META_LIST = 200, 10_000
MAX_COUNT = 10**15

#: Every record's pydantic config: a key the record does not have is refused, not ignored.
RECORD = ConfigDict(extra="forbid")

R = TypeVar("R")


# -- field types: strict (no "3" for 3, no true for 1), each bounded ------------------------------
def integer(lo: int, hi: int) -> Any:
    return Annotated[int, Strict(), Field(ge=lo, le=hi)]


def number(lo: float, hi: float = math.inf) -> Any:
    """A finite number in lo..hi, or null for NaN: JSON has no NaN, and the writer writes it as null."""
    return Annotated[float | None, Strict(), Field(ge=lo, le=hi, allow_inf_nan=False), AfterValidator(_nan)]


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def string(limit: int) -> Any:
    """Text of at most ``limit`` characters; pydantic refuses unpaired surrogates (not Unicode)."""
    return Annotated[str, Strict(), Field(max_length=limit)]


Name, Text, Flag = string(MAX_NAME), string(MAX_TEXT), Annotated[bool, Strict()]
Count, Rate = integer(0, MAX_COUNT), number(0)
Share = number(0, 1.5)  # of time or of cores; timer skew takes it a little over 1


@functools.cache
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def check(kind: Any, value: Any) -> Any:
    """``value`` validated as ``kind``, whose TypeAdapter is built on first use and kept."""
    return _adapter(kind).validate_python(value)


def refuse(loc: tuple[int | str, ...], problem: str, value: Any = None) -> NoReturn:
    """Refuse what ``loc`` names (from within a validator: relative to the value it checks)."""
    error = PydanticCustomError("refused", "{problem}", {"problem": problem})
    raise ValidationError.from_exception_data("refused", [InitErrorDetails(type=error, loc=loc, input=value)])


_SCALAR = Annotated[None | Flag | integer(-(2**63), 2**63 - 1) | number(-math.inf) | Text,
                    Field(union_mode="left_to_right")]


def _scalars(value: Any) -> Any:
    """A scalar, or a flat list of them: what settings and machine hold, nothing nested."""
    items = value if isinstance(value, list) else [value]
    if len(items) > MAX_META_LIST:
        refuse((), f"a list of {len(items)} items, more than the limit of {MAX_META_LIST}")
    for i, item in enumerate(items):
        try:
            check(_SCALAR, item)
        except ValidationError:
            refuse((i,) if isinstance(value, list) else (), "Input should be a string, number, bool or null, "
                   "or a flat list of those", item)
    return value


#: settings / machine: names to a scalar or a flat list of scalars.
Meta = Annotated[dict[Name, Annotated[Any, AfterValidator(_scalars)]], Field(max_length=MAX_META_KEYS)]


def rows(row: type, limit: int, index: str | None = None) -> PlainValidator:
    """A DataFrame that a file holds as a list of ``row`` records (at most ``limit``), one per row."""
    records = Annotated[list[row], Field(max_length=limit)]

    def read(value: Any) -> pd.DataFrame:
        frame = pd.DataFrame([asdict(r) for r in check(records, value)], columns=[f.name for f in fields(row)])
        return frame.set_index(index) if index else frame

    return PlainValidator(read)


# -- reading and writing ---------------------------------------------------------------------------
class Saved:
    """``to_json`` and ``from_json`` for a result type, by the ``Format`` that describes it."""

    def to_json(self, path: str | Path) -> Path:
        """Write plain JSON (checked against the reader's rules first); return the path."""
        return _FORMATS[type(self)].write(self, path)

    @classmethod
    def from_json(cls, path: str | Path) -> Self:
        """Read what ``to_json`` wrote: plain JSON, validated, never executed."""
        return _FORMATS[cls].read(path)


_FORMATS: dict[type, Format[Any]] = {}


@dataclass
class Format(Generic[R]):
    """One file format: ``{"format": name, "version": n, ...}`` and then the fields of a ``kind``."""

    name: str  # "spdl_lab.diagnosis"
    noun: str  # how messages name it: "diagnosis"
    kind: type[R]  # the result type: its fields are the file's, checked by pydantic
    versions: tuple[int, ...]  # read; the last one is written
    error: type[FileFormatError]
    fix: str  # what to do about a file that does not fit
    encode: Callable[[R], dict[str, Any]]  # a result's fields as the file holds them
    finish: Callable[[R, int], R] = lambda result, version: result  # checks across fields; older versions
    max_bytes: int = 50 * 2**20
    compact: bool = False  # one line without spaces, for files of long number arrays

    def __post_init__(self) -> None:
        _FORMATS[self.kind] = self

    def read(self, path: str | Path) -> R:
        """Read and check ``path``; a missing file raises the usual OSError."""
        path = Path(path)
        return self.parse(load(path, self.max_bytes, lambda where, what: self.fail(path, where, what)), path)

    def parse(self, doc: Any, source: str | Path, writing: bool = False) -> R:
        """A result from a parsed document, each field checked; else this format's error."""
        if doc.get("format") != self.name:
            raise self.fail(source, "format", f"expected {self.name!r}, got {describe(doc.get('format'))}", writing)
        version = doc.get("version")
        if type(version) is not int or version not in self.versions:  # True == 1 and 1.0 == 1 must not pass
            newer = type(version) is int and version > self.versions[-1]
            raise self.fail(source, "version", f"expected {' or '.join(map(str, self.versions))}, got "
                            f"{describe(version)}", writing, "Upgrade spdl_lab to read it" if newer else None)
        try:
            return self.finish(check(self.kind, {k: v for k, v in doc.items() if k not in ("format", "version")}),
                               version)
        except ValidationError as exc:
            raise self.refusal(exc, source, writing) from None

    def write(self, result: R, path: str | Path) -> Path:
        """Write ``result`` atomically, refusing now what ``read`` would refuse later."""
        try:
            doc = plain({"format": self.name, "version": self.versions[-1], **self.encode(result)})
        except ValidationError as exc:  # the encoder's own refusals
            raise self.refusal(exc, path, True) from None
        self.parse(doc, path, writing=True)
        return dump_file(doc, path, compact=self.compact)

    def refusal(self, exc: ValidationError, source: str | Path, writing: bool) -> FileFormatError:
        """Pydantic's first error, with its location, as this format's."""
        first = exc.errors(include_url=False)[0]
        return self.fail(source, _where(first["loc"]), first["msg"], writing)

    def fail(self, source: str | Path, where: str, problem: str, writing: bool = False,
             fix: str | None = None) -> FileFormatError:
        head = f"cannot write {self.noun} {source}" if writing else f"{self.noun} file {source}"
        fix = fix or (f"Correct that field of the {self.kind.__name__}" if writing else self.fix)
        return _failure(self.error, head, source, where, problem, fix)


def _failure(error: type[FileFormatError], head: str, source: str | Path, where: str, problem: str,
             fix: str) -> FileFormatError:
    return error(f"{head}:{f' {where}:' if where else ''} {problem}. {fix}.", source=str(source), field=where)


def read_any(path: Path, formats: Sequence[Format[Any]], fix: str) -> Any:
    """``path`` read as whichever of ``formats`` its ``format`` names."""
    def fail(where: str, problem: str) -> FileFormatError:
        return _failure(FileFormatError, f"spdl_lab file {path}", path, where, problem, fix)

    by_name = {f.name: f for f in formats}
    doc = load(path, max(f.max_bytes for f in formats), fail)
    if doc.get("format") not in by_name:
        raise fail("format", f"expected {' or '.join(map(repr, by_name))}, got {describe(doc.get('format'))}")
    return by_name[doc["format"]].parse(doc, path)


def load(path: Path, max_bytes: int, fail: Callable[[str, str], FileFormatError]) -> dict[str, Any]:
    """``path`` (at most ``max_bytes``) parsed as a strict JSON object, or ``fail``'s error."""
    if path.stat().st_size > max_bytes:
        raise fail("", f"{path.stat().st_size} bytes, larger than the limit of {max_bytes}")
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)  # the file may have grown since stat; /dev/zero never ends
    if len(data) > max_bytes:
        raise fail("", f"larger than the limit of {max_bytes} bytes")
    try:
        doc = loads(data)
    except ValueError as exc:  # JSONDecodeError, the digit limit, NaN, a key twice, nesting
        raise fail("", f"not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise fail("top level", f"expected an object, got {describe(doc)}")
    return doc


def _where(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as messages write it: ``stages[1].points[0].qps``, ``settings['a b']``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "[key]":  # pydantic's mark for a key itself, not its value
            path += " (the key)"
        else:
            path += f".{part}" if part.isidentifier() and len(part) <= 60 else f"[{_short(part)}]"
    return path.lstrip(".")


def describe(value: Any) -> str:
    """A value named for an error message, never longer than a line: "string 'pickle'", "object"."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an int of {value.bit_length()} bits"
    kind = {dict: "object", list: "array", str: "string", bool: "bool", type(None): "null"}.get(
        type(value), type(value).__name__)
    return kind if kind in ("object", "array", "null") else f"{kind} {_short(value)}"


def _short(value: Any, limit: int = 60) -> str:
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
