"""What both report files (a Diagnosis, a Comparison) share: a strict JSON reader, an atomic
writer, the field types of their pydantic schemas, and errors that name the file, the JSON path,
what was expected and what to do.

Reading executes nothing: ``load_document`` turns a file into dicts, lists, numbers and strings
only, and a format's ``Record`` schema checks every field of them before its dataclass is built.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, NoReturn, TypeVar, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WrapValidator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from .errors import FileFormatError

__all__ = ["Checker", "Meta", "Record", "at_most", "choice", "describe", "dump_document", "expects", "integer",
           "load_document", "number", "plain", "refuse", "short", "string"]

MAX_NAME, MAX_TEXT = 200, 100_000  # characters: names and short labels; evidence, tracebacks
MAX_META_KEYS, MAX_META_LIST = 200, 10_000
MAX_COUNT = 10**15


class Record(BaseModel):
    """An object of a report file: exactly its keys, each of exactly its type (no "3" for 3, no true for 1)."""

    model_config = ConfigDict(strict=True, extra="forbid")


R = TypeVar("R", bound=Record)


# -- field types: each says once what it expects, and its errors say that ---------------------
def expects(what: str) -> WrapValidator:
    """Whatever the wrapped type refuses reads "expected <what>, got <the value>"."""
    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("expected", "expected {what}, got {got}",
                                      {"what": what, "got": describe(value)}) from None
    return WrapValidator(check)


def _fits(limit: int) -> AfterValidator:
    def check(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if len(value) > limit:
            raise PydanticCustomError("too_long", "string of {n} characters is longer than the limit of {limit}",
                                      {"n": len(value), "limit": limit})
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: it would break every writer downstream
            raise PydanticCustomError("surrogate", "string holds an unpaired surrogate (not valid Unicode)") from None
        return value
    return AfterValidator(check)


def string(limit: int, null: bool = False) -> Any:
    return Annotated[str | None if null else str, expects("a string" + " or null" * null), _fits(limit)]


def choice(*values: str, null: bool = False) -> Any:
    kind = Literal[values]
    return Annotated[kind | None if null else kind,
                     expects("one of " + ", ".join(map(repr, values)) + " or null" * null)]


def integer(lo: int, hi: int, null: bool = False) -> Any:
    kind = Annotated[int, Field(ge=lo, le=hi)]
    return Annotated[kind | None if null else kind, expects(f"an integer in {lo}..{hi}" + " or null" * null)]


def number(lo: float, hi: float = math.inf) -> Any:
    """A finite number in lo..hi, or null for NaN: JSON has no NaN, and the writers write NaN and inf as null."""
    what = f"a number in {lo:g}..{hi:g}" if hi < math.inf else f"a number >= {lo:g}"
    finite = Annotated[float, Field(ge=lo, le=hi, allow_inf_nan=False)]
    return Annotated[finite | None, expects(f"{what} or null"), AfterValidator(_nan_for_null)]


def _nan_for_null(value: float | None) -> float:
    return math.nan if value is None else value


def at_most(limit: int | Callable[[], int], what: str) -> BeforeValidator:
    """An array's or object's length, checked before its items are. A function ``limit`` is
    called at each check, so a format's MAX_ constant can be changed after its schema is built."""
    def check(value: Any) -> Any:
        most = limit() if callable(limit) else limit
        if isinstance(value, (list, dict)) and len(value) > most:
            raise PydanticCustomError("too_many", "{n} {what}, more than the limit of {limit}",
                                      {"n": len(value), "what": what, "limit": most})
        return value
    return BeforeValidator(check)


def refuse(loc: tuple[int | str, ...], problem: str) -> NoReturn:
    """From a validator: refuse what ``loc`` (relative to the value validated) names, with ``problem``."""
    error = PydanticCustomError("refused", "{problem}", {"problem": problem})
    raise ValidationError.from_exception_data("refused", [InitErrorDetails(type=error, loc=loc, input=None)])


Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Scalar = Annotated[bool | Int64 | Annotated[float, Field(allow_inf_nan=False)] | str | None,
                   expects("a string, number, bool, null or a flat list of those"), _fits(MAX_TEXT)]
_SCALAR = TypeAdapter(Scalar, config=ConfigDict(strict=True))


def _one_or_list(value: Any, handler: Callable[[Any], Any]) -> Any:
    # Not a union of the two: its errors would name both, and the failing item of neither.
    return handler(value) if isinstance(value, list) else _SCALAR.validate_python(value)


#: settings / machine: a flat object of str to a scalar or a flat list of scalars.
Meta = Annotated[dict[string(MAX_NAME), Annotated[list[Scalar], at_most(MAX_META_LIST, "items"),
                                                WrapValidator(_one_or_list)]],
                 at_most(MAX_META_KEYS, "keys")]


# -- errors ----------------------------------------------------------------------------------
class Checker:
    """A file being read or written, and how its errors read.

    A format subclasses it to set ``noun`` ("diagnosis"), the advice its messages end
    with, and the exception class it raises.
    """

    noun: ClassVar[str] = "spdl_lab"
    read_fix: ClassVar[str] = "Only files written by spdl_lab can be read"
    write_fix: ClassVar[str] = "Correct that field"
    error: ClassVar[type[FileFormatError]] = FileFormatError

    def __init__(self, source: Path | str, writing: bool = False) -> None:
        self.source, self.writing = str(source), writing

    def fail(self, where: str, problem: str, fix: str | None = None) -> FileFormatError:
        head = f"cannot write {self.noun} {self.source}" if self.writing else f"{self.noun} file {self.source}"
        fix = fix or (self.write_fix if self.writing else self.read_fix)
        at = f" {where}:" if where else ""
        return self.error(f"{head}:{at} {problem}. {fix}.", source=self.source, field=where)

    def check_header(self, doc: dict[str, Any], fmt: str, version: int, older: tuple[int, ...] = ()) -> int:
        """``format`` first, then ``version`` (``version`` or one of the ``older`` ones still
        read), each with its own message; returns the version found."""
        if doc.get("format") != fmt:
            raise self.fail("format", f"expected {fmt!r}, got {describe(doc.get('format'))}")
        found, accepted = doc.get("version"), (*older, version)
        if type(found) is not int or found not in accepted:  # True == 1 and 1.0 == 1 must not pass
            fix = "Upgrade spdl_lab to read it" if type(found) is int and found > version else None
            raise self.fail("version", f"expected {' or '.join(map(str, accepted))}, got {describe(found)}", fix)
        return found

    def validate(self, schema: type[R], doc: dict[str, Any]) -> R:
        """``doc`` as ``schema``; its first error raised as this format's, by its JSON path."""
        try:
            return schema.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where, record = _json_path(schema, first["loc"])
            raise self.fail(where, _problem(first, record)) from None


#: What pydantic's own errors (those no ``expects`` rewrote) expected.
_EXPECTED = {"model_type": "an object", "dict_type": "an object", "list_type": "an array",
             # the long arrays of frames use pydantic's float without a wrapper: no call per value
             "float_type": "a finite number or null", "finite_number": "a finite number or null"}


def _problem(error: ErrorDetails, record: type[Record] | None) -> str:
    if error["type"] == "missing":
        return "key is missing"
    if error["type"] == "extra_forbidden":
        return f"unknown key (allowed: {', '.join(record.model_fields if record else ())})"
    if error["type"] in _EXPECTED:
        return f"expected {_EXPECTED[error['type']]}, got {describe(error['input'])}"
    return error["msg"]  # ours: they say what was expected and what came


def _json_path(schema: Any, loc: tuple[int | str, ...]) -> tuple[str, type[Record] | None]:
    """``loc`` as messages write it (``stages[1].points[0].qps``, ``settings['note']``), and the
    record whose key it ends with."""
    path, record = "", None
    for part in loc:
        while get_origin(schema) is Annotated:
            schema = get_args(schema)[0]
        inner = get_args(schema) or (None,)  # list[X]: (X,); dict[K, V]: (K, V)
        if isinstance(part, int):
            path, schema = f"{path}[{part}]", inner[0]
        elif isinstance(schema, type) and issubclass(schema, Record):
            field = schema.model_fields.get(part)
            path, record, schema = f"{path}.{key_path(part)}", schema, field and field.annotation
        elif part == "[key]":  # pydantic's mark for the key itself, not its value
            path += " key"
        else:
            path, schema = f"{path}[{short(part)}]", inner[-1]
    return path.lstrip("."), record


def describe(value: Any) -> str:
    """A value named for an error message, never longer than a line."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an int of {value.bit_length()} bits"
    kind = {dict: "object", list: "array", str: "string", bool: "bool", type(None): "null"}.get(
        type(value), type(value).__name__)
    return kind if kind in ("object", "array", "null") else f"{kind} {short(value)}"


def short(value: Any, limit: int = 60) -> str:
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def key_path(key: str) -> str:
    return key if key.isidentifier() and len(key) <= 60 else f"[{short(key)}]"


# -- reading and writing ---------------------------------------------------------------------
def plain(value: Any) -> Any:
    """``value`` as JSON takes it: tuples as lists, NaN and inf as null (JSON has neither),
    numpy numbers as Python's; anything else as it is, for the schema to refuse."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if math.isfinite(value) else None


def dump_document(doc: dict[str, Any], path: Path, *, compact: bool = False) -> Path:
    """Write ``doc`` as JSON to ``path`` atomically: a reader never sees half a file.

    ``compact`` writes one line without spaces, for documents of long number arrays.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        spacing: dict[str, Any] = {"separators": (",", ":")} if compact else {"indent": 1}
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, allow_nan=False, ensure_ascii=False, **spacing)
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
        raise checker.fail("top level", f"expected an object, got {describe(doc)}")
    return doc
