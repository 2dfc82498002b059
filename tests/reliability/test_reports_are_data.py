"""Reports are data: saved files are read as plain data, and nothing spdl_lab writes runs.

1. Every public ``from_json`` refuses hostile files cleanly (its own error, naming the
   file and the JSON path) and executes nothing; tests/diagnose/test_result.py
   has the spot checks, this file the exhaustive ones (every field, every object).
2. An audit of spdl_lab/'s source (ast): each place that unpickles, evaluates, imports
   by name, parses JSON or could listen is in ``ALLOWED`` with a one-line reason; the
   one place spdl_lab listens is a published run's endpoint, on an AF_UNIX socket.
3. Whatever listens while developing (the JupyterLab of the browser test, ``make lab``)
   binds 127.0.0.1 only.
4. Reports built from hostile names (to_html, _repr_html_, to_json, the terminal
   summary) carry them as text, never as markup, script or terminal control.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import math
import pickle
import re
from collections import Counter
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import spdl_lab as lab
from spdl_lab._diagnose.result import Diagnosis, Point, StageDiagnosis
from spdl_lab.errors import SpdlLabError

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "spdl_lab"
NAN = math.nan


# -- samples ---------------------------------------------------------------------------
def sample_diagnosis(name: str = "decode", text: str = "QPS stayed at 410 items/s.") -> Diagnosis:
    """Two map stages and a batch stage; ``name`` and ``text`` go wherever a user's strings go."""
    def point(stage: str, c: int, executor: str = "thread") -> Point:
        thread = executor == "thread"
        return Point(stage, executor, c, 100.0 * c, 0.02, 0.4, 0.1 * c if thread else NAN,
                     0.01 if thread else NAN, 2.0, 3, "ok", 0)

    stages = [
        StageDiagnosis(name, "map", "gil-bound", 1, text, text,
                       points=(point(name, 1), point(name, 2), point(name, 1, "process")),
                       inputs=64, outputs=64),
        StageDiagnosis("read", "map", None, None, text, "", points=(point("read", 1),),
                       inputs=64, outputs=0, error=f"Traceback (most recent call last):\nValueError: {text}"),
        StageDiagnosis("batch(8)", "batch", None, None, "Not swept.", "", inputs=64, outputs=8),
    ]
    return Diagnosis(pipeline=f"Pipeline(range(64)).map({name})", stages={s.name: s for s in stages},
                     settings={"concurrency": [1, 2], "note": text, "processes": True, "spread": None},
                     machine={"cores": 2, "python": "3.11"}, created="2025-01-02T03:04:05", elapsed_s=12.5)


def sample_comparison() -> Any:
    """A Comparison as lab.compare returns it, for a ``Comparison.from_json`` when there is one."""
    from spdl_lab._experiments.comparison import TABLE_COLUMNS
    from spdl_lab._telemetry.frames import FRAME_COLUMNS

    def value(column: str, i: int) -> float | int:
        if column == "steps":
            return 10
        if column.endswith("_frac") or column == "device_util":
            return 0.1 * (i + 1)
        return {"batches_per_s": 2.4, "cpu_percent": 150.0}.get(column, 50.0) + i

    table = pd.DataFrame([[value(c, i) for c in TABLE_COLUMNS] for i in range(len(lab.RUNNERS))],
                         index=pd.Index(lab.RUNNERS, name="runner"), columns=TABLE_COLUMNS)
    frames = {r: pd.DataFrame([[0.1, "step_ms", "step", 5.0], [0.2, "step_ms", "step", 6.0]],
                              columns=FRAME_COLUMNS) for r in lab.RUNNERS}
    return lab.Comparison(table=table, frames=frames, steps=10, warmup=2)


def sample_tuning() -> Any:
    """A Tuning as lab.tune returns it: a start and one kept move."""
    from spdl_lab._tune.search import Advice, Step
    from spdl_lab._tune.space import Config, Move, Trial

    p = lab.Pipeline(range(10)).map(abs, name="decode").batch(2)
    start, best = Config.of("thread", {"decode": 1}), Config.of("thread", {"decode": 4})

    def trial(config: Config, rate: float) -> Trial:
        return Trial(config=config, rates=(rate, rate * 1.01, rate * 0.99), step_p50_ms=5.0, data_wait_frac=0.2,
                     cpu_percent=80.0, train_gil_wait_frac=0.1, gil_wait_frac=0.05, elapsed_s=2.0)

    steps = [Step(trial(start, 10.0), Move("start", start), math.nan, "decode", True, "started from thread"),
             Step(trial(best, 30.0), Move("raise", best, "decode", 1, 4), 31.0, "step", True, "raised decode")]
    return lab.Tuning.build(pipeline=p, source_is_dataloader=False, start=start, best=steps[1].trial, steps=steps,
                            log=[s.sentence for s in steps], speedup=(3.0, 2.9, 3.1), budget_s=60.0,
                            elapsed_s=20.0, cores=2,
                            advice=Advice(True, "move to thread decode=4", ()))


#: One sample per public class that reads itself from JSON: a new reader must join.
SAMPLES: dict[str, Callable[[], Any]] = {"Diagnosis": sample_diagnosis, "Comparison": sample_comparison,
                                         "Tuning": sample_tuning}


def json_readers() -> dict[str, type]:
    return {name: obj for name in lab.__all__ if isinstance(obj := getattr(lab, name), type)
            and callable(getattr(obj, "from_json", None))}


def test_every_json_reader_is_covered_here():
    readers = json_readers()
    assert "Diagnosis" in readers
    missing = sorted(set(readers) - set(SAMPLES))
    assert not missing, f"add a sample of {missing} to SAMPLES so its from_json is tested with hostile files"


READERS = sorted(json_readers())


# -- hostile files -----------------------------------------------------------------------
def refused(reader: type, path: Path, *fragments: str) -> SpdlLabError:
    """``reader.from_json(path)`` fails with the library's own error naming ``path``."""
    with pytest.raises(SpdlLabError) as info:
        reader.from_json(path)
    error = info.value
    message = str(error)
    assert isinstance(error, ValueError), type(error)
    assert str(path) in message, message
    assert len(message) < 2000, f"message of {len(message)} characters: {message[:300]}..."
    assert isinstance(getattr(error, "field", None), str), "the error names the JSON path in .field"
    for fragment in fragments:
        assert fragment in message, message
    return error


@pytest.fixture
def marker(tmp_path) -> Iterator[Path]:
    """A file that only executed content could create; it must not exist afterwards."""
    path = tmp_path / "executed.marker"
    yield path
    assert not path.exists(), f"reading or rendering a report executed content: {path} was created"


class TouchOnUnpickle:
    """Pickles to a payload that creates ``path`` when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_the_marker_payload_is_live(tmp_path):
    """The control: unpickled, the payload does create its file, so its absence elsewhere means something."""
    control = tmp_path / "control.marker"
    pickle.loads(pickle.dumps(TouchOnUnpickle(control)))
    assert control.exists()


def _files(marker: Path, good: bytes) -> dict[str, tuple[bytes, str]]:
    """Whole files that are not a report, each with what its refusal must say.

    ``good`` is a report as its writer wrote it: most cases spoil it in one way
    only, so the refusal is for that way.
    """
    fmt = json.dumps(json.loads(good)["format"]).encode()
    version = f'"version": {json.loads(good)["version"]},'.encode()
    assert good.count(version) == 1 and good.count(fmt) == 1
    payload = pickle.dumps(TouchOnUnpickle(marker))

    def spoil(old: bytes, new: bytes) -> bytes:
        return good.replace(version if old == b'"version": 1,' else old, new)

    return {
        "empty": (b"", "not valid JSON"),
        "pickle": (payload, "not valid JSON"),
        "pickle protocol 0": (pickle.dumps(TouchOnUnpickle(marker), protocol=0), "not valid JSON"),
        "pickle in a string": (spoil(fmt, json.dumps(payload.decode("latin-1")).encode()), "format"),
        "jsonpickle": (json.dumps({"py/reduce": [{"py/function": "pathlib.Path.touch"},
                                                 {"py/tuple": [str(marker)]}]}).encode(), "format"),
        "__reduce__ object": (json.dumps({"__reduce__": ["pathlib.Path.touch", [str(marker)]]}).encode(), "format"),
        "yaml tag": (f"!!python/object/apply:pathlib.Path.touch [{marker}]".encode(), "not valid JSON"),
        "python source": (f"__import__('pathlib').Path({str(marker)!r}).touch()".encode(), "not valid JSON"),
        "NaN": (spoil(b'"version": 1,', b'"version": NaN,'), "NaN"),
        "Infinity": (spoil(b'"version": 1,', b'"version": Infinity,'), "Infinity"),
        "-Infinity": (spoil(b'"version": 1,', b'"version": -Infinity,'), "Infinity"),
        "1e400": (spoil(b'"version": 1,', b'"version": 1e400,'), "version"),
        "10**400": (spoil(b'"version": 1,', b'"version": 1' + b"0" * 400 + b","), "version"),
        "5000 digits": (spoil(b'"version": 1,', b'"version": ' + b"9" * 5000 + b","), "not valid JSON"),
        "duplicate keys": (b'{"format": ' + fmt + b", " + good.lstrip()[1:], "twice"),
        "latin-1 byte": (spoil(fmt, fmt[:-1] + b'\xff"'), "not valid JSON"),
        "UTF-8 BOM": (b"\xef\xbb\xbf" + good, "not valid JSON"),
        "UTF-16": (good.decode().encode("utf-16"), "not valid JSON"),
        "NUL bytes": (b"\x00" * 64, "not valid JSON"),
        "100k nested arrays": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        "100k nested objects": (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
        "deep inside a field": (spoil(b'"version": 1,', b'"version": ' + b"[" * 50_000 + b"]" * 50_000 + b","),
                                "nested too deeply"),
        "top-level string": (fmt, "top level"),
        "top-level null": (b"null", "top level"),
        "top-level array": (b"[" + good + b"]", "top level"),
        "truncated": (good[:-2], "not valid JSON"),
    }


def each(cases: dict[str, Any], check: Callable[[str, Any], None]) -> None:
    """Run ``check`` on every case, naming the case that failed (one test, not one per case:
    the hygiene check after each test costs more than these reads)."""
    for case, value in cases.items():
        try:
            check(case, value)
        except (AssertionError, pytest.fail.Exception) as exc:
            raise AssertionError(f"case {case!r}: {exc}") from exc


@pytest.mark.parametrize("reader", READERS)
def test_hostile_file_is_refused(tmp_path, marker, reader):
    def check(case: str, spoilt: tuple[bytes, str]) -> None:
        path = tmp_path / "report.json"
        path.write_bytes(spoilt[0])
        refused(json_readers()[reader], path, spoilt[1])

    good = json.dumps(_written(reader, tmp_path)).encode()  # one spacing, whatever the writer's
    json_readers()[reader].from_json(_write(tmp_path, json.loads(good), "good.json"))  # reads as it is
    each(_files(marker, good), check)


@pytest.mark.parametrize("reader", READERS)
def test_huge_file_is_refused_by_its_size(tmp_path, reader):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(2**31)  # sparse: 2 GiB on paper, no disk
    refused(json_readers()[reader], path, "larger than the limit")


@pytest.mark.parametrize("reader", READERS)
def test_endless_file_is_refused_after_the_limit(reader):
    # /dev/zero says it is empty and never ends: the reader must stop at its limit.
    refused(json_readers()[reader], Path("/dev/zero"), "larger than the limit")


# -- every field, every object of a real report ---------------------------------------
INF_TEXT = "@@1e400@@"  # json.dumps cannot write 1e400; it is put in the text afterwards


def _leaves(doc: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _leaves(value, (*path, i))
    else:
        yield path


def _objects(doc: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(doc, dict):
        yield path
        for key, value in doc.items():
            yield from _objects(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _objects(value, (*path, i))


def _at(doc: Any, path: tuple) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _named(field: str, path: tuple) -> bool:
    """Whether the error's JSON path names the element ``path`` ends with."""
    last = path[-1]
    return (f"[{last}]" if isinstance(last, int) else str(last)) in field


def _written(reader: str, tmp_path: Path) -> dict:
    path = SAMPLES[reader]().to_json(tmp_path / "good.json")
    return json.loads(path.read_text(encoding="utf-8"))


def _write(tmp_path: Path, doc: Any, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc).replace(json.dumps(INF_TEXT), "1e400"), encoding="utf-8")
    return path


@pytest.mark.parametrize("reader", READERS)
def test_every_field_refuses_values_of_no_type_it_takes(tmp_path, marker, reader):
    """Each leaf of a written report, replaced by 1e400, 10**400 or an object, is refused by its path."""
    cls = json_readers()[reader]
    good = _written(reader, tmp_path)
    cls.from_json(_write(tmp_path, good, "good.json"))  # the unedited file reads
    hostile = [INF_TEXT, 10**400, {"py/object": "pathlib.Path", "__reduce__": [str(marker)]}]
    checked = 0
    for path in _leaves(good):
        for value in hostile:
            doc = copy.deepcopy(good)
            _at(doc, path[:-1])[path[-1]] = value
            error = refused(cls, _write(tmp_path, doc))
            assert _named(error.field, path), f"{path} = {str(value)[:20]}: error names {error.field!r}"
            checked += 1
    assert checked >= 3 * 30


@pytest.mark.parametrize("reader", READERS)
def test_every_object_refuses_code_looking_keys(tmp_path, marker, reader):
    """``__reduce__`` / ``py/object`` keys added to any object are refused by their path."""
    cls = json_readers()[reader]
    good = _written(reader, tmp_path)
    for path in _objects(good):
        for key in ("__reduce__", "py/object", "__class__"):
            doc = copy.deepcopy(good)
            _at(doc, path)[key] = {"py/reduce": [{"py/function": "pathlib.Path.touch"}, [str(marker)]]}
            error = refused(cls, _write(tmp_path, doc))
            assert key in error.field, f"{key} added at {path}: error names {error.field!r}"


CODE_STRINGS = [
    "__import__('pathlib').Path({marker!r}).touch()",
    "!!python/object/apply:pathlib.Path.touch [{marker}]",
    '{{"py/reduce": [{{"py/function": "pathlib.Path.touch"}}, {{"py/tuple": ["{marker}"]}}]}}',
    "$(touch {marker}) `touch {marker}`",
]


def test_strings_that_look_like_code_stay_strings(tmp_path, marker):
    """Read, rendered and written again, a report whose names are code only ever holds them as text."""
    def check(_: str, code: str) -> None:
        text = code.format(marker=str(marker))
        diag = sample_diagnosis(name=text[:200], text=text)
        back = lab.Diagnosis.from_json(diag.to_json(tmp_path / "code.json"))
        assert list(back.stages) == list(diag.stages) and back.settings["note"] == text
        assert back.stages[text[:200]].evidence == text
        repr(back), back._repr_html_(), back.table, back.verdicts(), back.summary()
        back.to_html(tmp_path / "code.html")
        again = back.to_json(tmp_path / "again.json")
        assert json.loads(again.read_text(encoding="utf-8")) == json.loads(
            (tmp_path / "code.json").read_text(encoding="utf-8"))

    each(dict(enumerate(CODE_STRINGS)), check)


# -- the audit ---------------------------------------------------------------------------
#: Calls that unpickle, evaluate, import by name, parse untrusted text, or open a
#: channel that unpickles, resolved through each module's imports.
RISKY_CALLS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler",
    "cloudpickle.load", "cloudpickle.loads", "dill.load", "dill.loads", "joblib.load", "torch.load",
    "marshal.load", "marshal.loads", "shelve.open", "yaml.load", "yaml.load_all", "yaml.unsafe_load",
    "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all", "numpy.load", "pandas.read_pickle",
    "jsonpickle.decode", "builtins.eval", "builtins.exec", "builtins.compile", "builtins.__import__",
    "importlib.import_module", "importlib.__import__", "runpy.run_path", "runpy.run_module",
    "code.interact", "json.load", "json.loads", "pandas.read_json", "torch.utils.data.DataLoader",
    "multiprocessing.connection.Listener", "multiprocessing.connection.Client",
    "multiprocessing.connection.Connection", "multiprocessing.Pipe", "multiprocessing.Queue",
    "multiprocessing.SimpleQueue", "multiprocessing.JoinableQueue", "multiprocessing.Manager",
    "socket.socket", "socket.create_server", "socket.socketpair", "socket.fromfd",
    "asyncio.start_server", "asyncio.start_unix_server",
}
RISKY_PREFIXES = ("socketserver.", "http.server.", "xmlrpc.server.", "wsgiref.simple_server.",
                  "bokeh.server.", "tornado.", "aiohttp.web", "multiprocessing.managers.")
#: Methods flagged on any receiver: ``Connection.recv`` unpickles; the rest serve.
RISKY_METHODS = {"recv", "bind", "listen", "accept", "serve_forever"}
SERVING = {"bind", "listen", "accept", "serve_forever", "socket.socket", "socket.create_server",
           "socket.fromfd", "asyncio.start_server", "asyncio.start_unix_server",
           "multiprocessing.connection.Listener", *RISKY_PREFIXES}
_BUILTINS = {"eval", "exec", "compile", "__import__"}
_UNPICKLERS = {"pickle.Unpickler", "_pickle.Unpickler"}

#: Every risky site in spdl_lab/: "file::scope::operation" -> why it is safe.
ALLOWED = {
    "spdl_lab/_watch/hook.py::dataloader_kwargs::json.loads":
        "stdlib-only hook: the user's own $SPDL_LAB_DATALOADER_KWARGS, an object of identifier keys only",
    "spdl_lab/workloads/jobs/train_images.py::main::torch.utils.data.DataLoader":
        "a job the user runs as their own script; its workers read the JPEG files it made",
    "spdl_lab/workloads/jobs/train_ddp.py::make_loader::torch.utils.data.DataLoader":
        "a job the user runs as their own script (torchrun); its workers make their items from indices",
    "spdl_lab/_runners/__init__.py::runner_class::importlib.import_module":
        "imports one of the four runner modules named in its own fixed table, never a name from outside",
    "spdl_lab/_cli_inputs.py::import_attr::importlib.import_module":
        "imports the module the user named on the spdl-lab command line, as `python -m` would",
    "spdl_lab/_views.py::view::importlib.import_module":
        "imports a module named by a view that spdl_lab's own __init__ registered, never a name from outside",
    "spdl_lab/_json.py::loads::json.loads":
        "the one strict JSON reader: no NaN, no duplicate keys, depth capped; file_checks caps the size, checks every field",
    "spdl_lab/_diagnose/_isolated_child.py::main::multiprocessing.connection.Connection":
        "wraps the two pipe ends the diagnose child inherited from the parent that spawned it",
    "spdl_lab/_diagnose/_isolated_child.py::main::.recv()":
        "the diagnose child's first message, from the parent that spawned it, over its inherited pipe",
    "spdl_lab/_diagnose/_isolated_child.py::main::cloudpickle.loads":
        "the pipeline the parent pickled for this child to diagnose; user code by design",
    "spdl_lab/_diagnose/_sweep_child.py::main::multiprocessing.connection.Connection":
        "wraps the two pipe ends the sweep child inherited from the parent that spawned it",
    "spdl_lab/_diagnose/_sweep_child.py::main::.recv()":
        "the sweep child's first message, from the parent that spawned it, over its inherited pipe",
    "spdl_lab/_diagnose/_sweep_child.py::main::cloudpickle.loads":
        "the stage function and inputs the parent pickled for this child; user code by design",
    "spdl_lab/_diagnose/_sweep_child.py::_Worker.obey::.recv()":
        "control messages from the parent that spawned this sweep child, over its inherited pipe",
    "spdl_lab/_watch/attach.py::EndpointClient._connect::socket.socket":
        "an AF_UNIX socket a viewer connects with, to a run's socket in the user's 0700 runtime dir",
    "spdl_lab/_watch/endpoint.py::Endpoint._accept_loop::.accept()":
        "viewers of the AF_UNIX endpoint in the user's 0700 runtime dir; at most max_viewers at once",
    "spdl_lab/_watch/endpoint.py::Endpoint._answers::socket.socket":
        "an AF_UNIX probe: is this process's own endpoint at that path already answering?",
    "spdl_lab/_watch/endpoint.py::Endpoint._listen::.bind()":
        "binds an AF_UNIX path in the user's 0700 runtime dir (mode 0600): nothing off this host",
    "spdl_lab/_watch/endpoint.py::Endpoint._listen::.listen()":
        "the published run's AF_UNIX endpoint; JSON messages only, size-capped, refused if malformed",
    "spdl_lab/_watch/endpoint.py::Endpoint._listen::socket.socket":
        "the published run's listener: AF_UNIX (tests/watch/test_endpoint.py checks the dir is 0700)",
    "spdl_lab/_runners/children.py::spawn::multiprocessing.connection.Connection":
        "wraps pipes to a child this process just spawned; no one else holds them",
    "spdl_lab/_runners/children.py::receive::.recv()":
        "unpickles only messages from a child this process spawned, over a pipe only it holds",
    "spdl_lab/_runners/subprocess_threads.py::main::multiprocessing.connection.Connection":
        "wraps the two pipe ends the subprocess-threads child inherited from its parent",
    "spdl_lab/_runners/subprocess_threads.py::main::.recv()":
        "the child's start message from the parent that spawned it, over its inherited pipe",
    "spdl_lab/_runners/_ray_plan.py::_Stages.__init__::cloudpickle.loads":
        "the stage function this process pickled in build(), unpickled in the Ray worker that runs it",
    "spdl_lab/_runners/subprocess_threads.py::_ChildRun.__init__::cloudpickle.loads":
        "the pipeline the parent pickled for this child; it runs user code by design",
    "spdl_lab/_runners/subprocess_threads.py::_ChildRun._control::.recv()":
        "control messages from the parent that spawned this child, over its inherited pipe",
    "spdl_lab/_runners/_transport.py::pickled::pickle.loads":
        "round-trips an exception this process just pickled, to check another process could rebuild it",
    "spdl_lab/_runners/process.py::PipelineDataset._load::pickle.loads":
        "the pipeline this DataLoader worker's parent pickled into the dataset; user code by design",
    "spdl_lab/_runners/_transport.py::<module>::subclass of pickle.Unpickler":
        "decodes outputs of our own subprocess-threads child; array ids only point into slots the parent made",
    "spdl_lab/_runners/process.py::ProcessRunner._new_dataloader::torch.utils.data.DataLoader":
        "torch unpickles batches only from the worker processes it spawns for this DataLoader",
    "spdl_lab/_runners/subprocess_threads.py::SubprocessThreadsRunner.read::pickle.loads":
        "meters our own child wrote into a 0600 segment named with a random token this runner chose",
    "spdl_lab/_runners/_transport.py::RemoteFailure.error::pickle.loads":
        "an exception our own child pickled and sent over the pipe only it holds",
    "spdl_lab/workloads/_steps.py::dataloader::torch.utils.data.DataLoader":
        "torch unpickles batches only from the worker processes it spawns for this DataLoader",
    "spdl_lab/workloads/_text.py::PythonTokenize.vocab::json.load":
        "the tokenizer file the lab trained into its own cache folder; parsed as JSON, only its vocab is read",
}


class _Finder(ast.NodeVisitor):
    """Risky calls in one module, with the function or class they sit in."""

    def __init__(self, module: str) -> None:
        self.package = module.rsplit(".", 1)[0]
        self.aliases: dict[str, str] = {}
        self.scope: list[str] = []
        self.found: list[tuple[str, str, int]] = []  # (scope, operation, line)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.aliases[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:
            parts = self.package.split(".")
            module = ".".join(parts[: len(parts) - node.level + 1] + ([module] if module else []))
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"

    def resolve(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return self.aliases[node.id]
            return f"builtins.{node.id}" if node.id in _BUILTINS else None
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def _within(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._within(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            if self.resolve(base) in _UNPICKLERS:
                self._add(f"subclass of {self.resolve(base)}", node)
        self._within(node, node.name)

    def visit_Call(self, node: ast.Call) -> None:
        name = self.resolve(node.func)
        if name and (name in RISKY_CALLS or name.startswith(RISKY_PREFIXES)):
            self._add(name, node)
        elif isinstance(node.func, ast.Attribute) and node.func.attr in RISKY_METHODS:
            self._add(f".{node.func.attr}()", node)
        self.generic_visit(node)

    def _add(self, operation: str, node: ast.AST) -> None:
        self.found.append((".".join(self.scope) or "<module>", operation, node.lineno))


def risky_sites(root: Path) -> dict[str, list[str]]:
    """``file::scope::operation`` -> the ``file:line`` of each occurrence."""
    sites: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        module = rel.removesuffix(".py").replace("/", ".")
        finder = _Finder(module)
        finder.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        for scope, operation, line in finder.found:
            sites.setdefault(f"{rel}::{scope}::{operation}", []).append(f"{rel}:{line}")
    return sites


def test_audit_finds_what_it_looks_for():
    """The scanner itself: aliases, from-imports, methods and subclasses are all seen."""
    source = (
        "import pickle as p\nfrom yaml import load\nimport multiprocessing.connection\n"
        "class D(p.Unpickler): pass\n"
        "def f(conn, s):\n    p.loads(b'')\n    load('')\n    eval('1')\n    conn.recv()\n"
        "    s.bind(('0', 1))\n    multiprocessing.connection.Listener()\n"
    )
    finder = _Finder("spdl_lab.x")
    finder.visit(ast.parse(source))
    assert {op for _, op, _ in finder.found} == {
        "subclass of pickle.Unpickler", "pickle.loads", "yaml.load", "builtins.eval", ".recv()", ".bind()",
        "multiprocessing.connection.Listener"}


def test_every_unpickle_eval_and_server_site_is_justified():
    sites = risky_sites(PACKAGE)
    unjustified = {key: where for key, where in sites.items() if key not in ALLOWED}
    assert not unjustified, (
        "new sites that unpickle, evaluate, import by name, parse JSON or serve; make sure only data "
        "this process made (or a child it started) reaches them, then add each to ALLOWED with why:\n  "
        + "\n  ".join(f"{key}  ({', '.join(where)})" for key, where in sorted(unjustified.items()))
    )
    stale = sorted(set(ALLOWED) - set(sites))
    assert not stale, f"ALLOWED names sites that no longer exist; remove them: {stale}"
    for key, why in ALLOWED.items():
        assert why.strip() and "\n" not in why and len(why) <= 120, f"{key}: one line of justification"


#: The one place spdl_lab serves: a published run's endpoint (issue 17), on an AF_UNIX socket.
ENDPOINT_SITES = {
    "spdl_lab/_watch/endpoint.py::Endpoint._listen::socket.socket",
    "spdl_lab/_watch/endpoint.py::Endpoint._listen::.bind()",
    "spdl_lab/_watch/endpoint.py::Endpoint._listen::.listen()",
    "spdl_lab/_watch/endpoint.py::Endpoint._accept_loop::.accept()",
    "spdl_lab/_watch/endpoint.py::Endpoint._answers::socket.socket",
    "spdl_lab/_watch/attach.py::EndpointClient._connect::socket.socket",
}


def test_spdl_lab_listens_only_on_its_unix_socket():
    serving = {key: where for key, where in risky_sites(PACKAGE).items()
               if key.rsplit("::", 1)[1].strip(".()") in SERVING or key.rsplit("::", 1)[1].startswith(RISKY_PREFIXES)}
    assert set(serving) == ENDPOINT_SITES, f"spdl_lab opens a server or binds a socket elsewhere: {serving}"
    # Every socket spdl_lab makes is AF_UNIX: nothing can be reached from another host.
    for source, tree in _python_sources():
        if not source.startswith("spdl_lab/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "socket.socket":
                family = ast.unparse(node.args[0]) if node.args else ""
                assert family == "socket.AF_UNIX", f"{source}:{node.lineno}: {ast.unparse(node)} is not AF_UNIX"


# -- what listens during development binds 127.0.0.1 ------------------------------------
LOOPBACK = "127.0.0.1"
_SERVER_WORDS = {"lab", "notebook", "server", "jupyterlab", "jupyter_server", "notebook.app"}


def _jupyter_commands(tree: ast.AST) -> Iterator[list[str]]:
    """List literals that start a Jupyter server (``[..., "-m", "jupyterlab", ...]`` and the like)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if any(w.startswith("jupyter") for w in words) and _SERVER_WORDS & set(words):
                yield words


@functools.cache
def _python_sources() -> tuple[tuple[str, ast.Module], ...]:
    """(path from the repo root, parsed module) of every Python file in the tree's code folders."""
    return tuple((path.relative_to(REPO).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
                 for folder in ("tests", "tools", "benchmarks", "spdl_lab")
                 for path in sorted((REPO / folder).rglob("*.py")))


def test_jupyter_servers_bind_loopback_only():
    commands = []
    for source, tree in _python_sources():
        for words in _jupyter_commands(tree):
            commands.append((source, words))
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    for line in makefile.splitlines():
        if line.startswith("\t") and re.search(r"jupyter[ -](lab|notebook|server)\b", line):
            commands.append(("Makefile", line.split()))
    assert any(source == "Makefile" for source, _ in commands), "make lab starts no jupyter lab any more?"
    assert any(source.startswith("tests/") for source, _ in commands), "the browser test starts no jupyter lab?"
    for source, words in commands:
        ips = [w.split("=", 1)[1] for w in words if re.match(r"--(ServerApp\.|NotebookApp\.)?ip=", w)]
        assert ips == [LOOPBACK], f"{source}: jupyter must bind --ip={LOOPBACK} only, got {ips}: {words}"


def test_sockets_bound_in_tests_and_tools_are_loopback():
    binds = 0
    for source, tree in _python_sources():
        if source == "spdl_lab/_watch/endpoint.py":
            continue  # its AF_UNIX bind: test_spdl_lab_listens_only_on_its_unix_socket
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind":
                address = node.args[0] if node.args else None
                host = address.elts[0] if isinstance(address, ast.Tuple) and address.elts else None
                assert isinstance(host, ast.Constant) and host.value == LOOPBACK, (
                    f"{source}:{node.lineno}: bind to {LOOPBACK} only, got {ast.unparse(node)}")
                binds += 1
    assert binds >= 1  # tests/ui/jupyter_browser.py picks its port that way


# -- reports carry hostile names as text -------------------------------------------------
EVIL_NAME = "</script><img src=x onerror=alert(1)><!--"
EVIL_TEXT = ("<script>alert(1)</script> \" onmouseover=\"alert(2) ' javascript:alert(3) ]]> "
             "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202eevil")


class _Markup(HTMLParser):
    """Tags, attributes and script bodies of a page, as a browser would split them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: Counter[str] = Counter()
        self.attributes: list[tuple[str, str, str | None]] = []
        self.scripts: list[str] = []
        self.comments: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags[tag] += 1
        self.attributes += [(tag, k, v) for k, v in attrs]
        if tag == "script":
            self._in_script = True
            self.scripts.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data

    def handle_comment(self, data: str) -> None:
        self.comments.append(data)


def _markup(html: str) -> _Markup:
    parsed = _Markup()
    parsed.feed(html)
    parsed.close()
    return parsed


def _assert_inert(evil: _Markup, plain: _Markup, where: str) -> None:
    assert evil.tags == plain.tags, f"{where}: hostile names changed the page's elements"
    assert len(evil.scripts) == len(plain.scripts)
    assert evil.comments == plain.comments
    for tag, name, value in evil.attributes:
        assert not name.startswith("on"), f"{where}: event handler <{tag} {name}={value!r}>"
        assert "javascript:" not in (value or "").lower(), f"{where}: <{tag} {name}={value!r}>"
    for script in evil.scripts:
        for text in (EVIL_NAME, "<script>alert(1)", "onmouseover=\"alert(2)"):
            assert text not in script, f"{where}: a script body holds the raw text {text!r}"


def test_html_reports_hold_hostile_names_as_text(tmp_path):
    evil, plain = sample_diagnosis(EVIL_NAME, EVIL_TEXT), sample_diagnosis()
    _assert_inert(_markup(evil._repr_html_()), _markup(plain._repr_html_()), "Diagnosis._repr_html_")
    pages = [d.to_html(tmp_path / f"{n}.html").read_text(encoding="utf-8") for n, d in (("e", evil), ("p", plain))]
    _assert_inert(_markup(pages[0]), _markup(pages[1]), "Diagnosis.to_html")


def test_comparison_report_holds_hostile_labels_as_text(tmp_path):
    from spdl_lab._ui.report import write_comparison_report

    def page(label: str, title: str, note: str) -> str:
        cmp = sample_comparison()
        cmp.table = cmp.table.rename(index={"thread": label})
        cmp.frames = {label if r == "thread" else r: f for r, f in cmp.frames.items()}
        return write_comparison_report(cmp, tmp_path / "c.html", title=title, note=note).read_text(encoding="utf-8")

    _assert_inert(_markup(page(EVIL_NAME, EVIL_TEXT, EVIL_TEXT)), _markup(page("thread", "t", "n")),
                  "write_comparison_report")


def test_json_report_is_plain_data(tmp_path, marker):
    diag = sample_diagnosis(EVIL_NAME, EVIL_TEXT)
    diag.settings.update({"__reduce__": str(marker), "py/object": "pathlib.Path.touch"})
    path = diag.to_json(tmp_path / "evil.json")
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"\b(NaN|Infinity)\b", text)

    def only_plain(value: Any, where: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                assert isinstance(k, str)
                only_plain(v, f"{where}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                only_plain(v, f"{where}[{i}]")
        else:
            assert value is None or isinstance(value, (str, bool, int, float)), (where, value)

    only_plain(json.loads(text))
    back = lab.Diagnosis.from_json(path)
    assert back.stages[EVIL_NAME].evidence == EVIL_TEXT  # text in, the same text out
    assert back.settings["__reduce__"] == str(marker) and back.settings["py/object"] == "pathlib.Path.touch"


def test_terminal_summary_holds_no_control_characters():
    """``print(diag)`` of a report someone sent must not drive the terminal (ESC, BEL, CSI, bidi)."""
    text = sample_diagnosis("\x1b[31mred\x1b[0m", EVIL_TEXT).summary()
    controls = sorted({f"U+{ord(c):04X}" for c in text if c != "\n" and not c.isprintable()})
    assert not controls, f"the summary passes control characters to the terminal: {controls}"
    assert "\\x1b" in text  # shown, escaped, not dropped
