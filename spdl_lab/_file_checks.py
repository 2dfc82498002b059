"""What every saved result (Diagnosis, Comparison, Tuning) shares: field types that pydantic checks
against its dataclasses, and one strict reader and writer whose errors name the file, the JSON
location and what was expected. Reading executes nothing."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Annotated, Any, ClassVar, NoReturn

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

MAX_NAME, MAX_TEXT = 200, 100_000  # characters: names and short labels; evidence, tracebacks
MAX_META_KEYS, MAX_META_LIST = 200, 10_000
MAX_COUNT = 10**15

#: Every record's pydantic config: a key the record does not have is refused, not ignored.
RECORD = ConfigDict(extra="forbid")


# -- field types: strict (no "3" for 3, no true for 1), each bounded ------------------------------
def integer(lo: int, hi: int) -> Any:
    return Annotated[int, Strict(), Field(ge=lo, le=hi)]


def number(lo: float, hi: float = math.inf) -> Any:
    """A finite number in lo..hi, or null for NaN: JSON has no NaN, and the writer writes it as null."""
    return Annotated[float | None, Strict(), Field(ge=lo, le=hi, allow_inf_nan=False),
                     AfterValidator(lambda value: math.nan if value is None else value)]


def string(limit: int) -> Any:
    """Text of at most ``limit`` characters; pydantic refuses unpaired surrogates (not Unicode)."""
    return Annotated[str, Strict(), Field(max_length=limit)]


Name, Text, Flag = string(MAX_NAME), string(MAX_TEXT), Annotated[bool, Strict()]
Count, Rate = integer(0, MAX_COUNT), number(0)
Share = number(0, 1.5)  # of time or of cores; timer skew takes it a little over 1


_adapter = functools.cache(TypeAdapter)


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


class Saved:
    """A result saved as ``{"format": "spdl_lab.<its class>", "version": n, ...}`` and its dataclass
    fields; a subclass sets the ClassVars and may override ``_saved_fields`` and ``_checked``."""

    VERSIONS: ClassVar[tuple[int, ...]] = (1,)  # read; the last one is written
    ERROR: ClassVar[type[FileFormatError]] = FileFormatError
    FIX: ClassVar[str] = "Only files written by to_json can be read"  # what to do about a file that does not fit
    MAX_BYTES: ClassVar[int] = 50 * 2**20
    COMPACT: ClassVar[bool] = False  # one line without spaces, for files of long number arrays

    def _saved_fields(self) -> dict[str, Any]:
        """The fields as the file holds them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _checked(self, version: int) -> Self:
        """Checks across fields, and what a file of an older ``version`` lacks."""
        return self

    def to_json(self, path: str | Path) -> Path:
        """Write plain JSON (checked against the reader's rules first); return the path."""
        try:
            doc = plain({"format": self._format(), "version": self.VERSIONS[-1], **self._saved_fields()})
        except ValidationError as exc:  # the encoder's own refusals
            raise self._refusal(exc, path, True) from None
        self._parse(doc, path, writing=True)
        return dump_file(doc, path, compact=self.COMPACT)

    @classmethod
    def from_json(cls, path: str | Path) -> Self:
        """Read what ``to_json`` wrote: plain JSON, validated, never executed (a missing file: OSError)."""
        path = Path(path)
        return cls._parse(load(path, cls.MAX_BYTES, lambda where, what: cls._fail(path, where, what)), path)

    @classmethod
    def _format(cls) -> str:
        return f"spdl_lab.{cls.__name__.lower()}"

    @classmethod
    def _parse(cls, doc: dict[str, Any], source: str | Path, writing: bool = False) -> Self:
        if doc.get("format") != cls._format():
            raise cls._fail(source, "format", f"expected {cls._format()!r}, got {describe(doc.get('format'))}",
                            writing)
        version = doc.get("version")
        if type(version) is not int or version not in cls.VERSIONS:  # True == 1 and 1.0 == 1 must not pass
            newer = type(version) is int and version > cls.VERSIONS[-1]
            raise cls._fail(source, "version", f"expected {' or '.join(map(str, cls.VERSIONS))}, got "
                            f"{describe(version)}", writing, "Upgrade spdl_lab to read it" if newer else None)
        try:
            return check(cls, {k: v for k, v in doc.items() if k not in ("format", "version")})._checked(version)
        except ValidationError as exc:
            raise cls._refusal(exc, source, writing) from None

    @classmethod
    def _refusal(cls, exc: ValidationError, source: str | Path, writing: bool) -> FileFormatError:
        first = exc.errors(include_url=False)[0]
        return cls._fail(source, _where(first["loc"]), first["msg"], writing)

    @classmethod
    def _fail(cls, source: str | Path, where: str, problem: str, writing: bool = False,
              fix: str | None = None) -> FileFormatError:
        noun = cls.__name__.lower()
        head = f"cannot write {noun} {source}" if writing else f"{noun} file {source}"
        fix = fix or (f"Correct that field of the {cls.__name__}" if writing else cls.FIX)
        return _failure(cls.ERROR, head, source, where, problem, fix)


def _failure(error: type[FileFormatError], head: str, source: str | Path, where: str, problem: str,
             fix: str) -> FileFormatError:
    return error(f"{head}:{f' {where}:' if where else ''} {problem}. {fix}.", source=str(source), field=where)


def read_any(path: Path, kinds: Sequence[type[Saved]], fix: str) -> Any:
    """``path`` read as whichever of ``kinds`` its ``format`` names."""
    def fail(where: str, problem: str) -> FileFormatError:
        return _failure(FileFormatError, f"spdl_lab file {path}", path, where, problem, fix)

    by_format = {kind._format(): kind for kind in kinds}
    doc = load(path, max(kind.MAX_BYTES for kind in kinds), fail)
    if doc.get("format") not in by_format:
        raise fail("format", f"expected {' or '.join(map(repr, by_format))}, got {describe(doc.get('format'))}")
    return by_format[doc["format"]]._parse(doc, path)


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
