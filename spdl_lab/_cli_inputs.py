"""What the ``spdl-lab`` command reads (``module:attr`` targets, ``--step`` specs, the saved files
``spdl-lab report`` renders) and where it writes; errors (``PipelineSpecError``, ``UsageError``:
exit 2) say in one line what was wrong and what to do."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._diagnose.env_mode import DEFAULT_REPORT_DIR, ENV_REPORT_DIR
from ._diagnose.result import Diagnosis
from ._experiments.compare import Comparison
from ._file_checks import read_any
from ._pipeline import Pipeline
from ._training.device import DEFAULT_KERNEL_US, DEFAULT_LAUNCH_US, SimulatedDevice
from .errors import FileFormatError, PipelineSpecError, SpdlLabError, UsageError

#: The command's exit statuses (``cli.EXIT_CODES`` says what each means).
EXIT_OK, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 2, 3, 130


def import_attr(target: str, what: str) -> Any:
    """The object ``module:attr`` names (dotted attr paths work), imported, never evaluated."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PipelineSpecError(
            f"expected module:attr for the {what} (e.g. mypkg.data:pipeline), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to you are found
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PipelineSpecError(f"cannot import {module_name!r}: {exc}; run spdl-lab from the folder "
                                "that holds it, or install it") from exc
    except Exception as exc:  # the module itself raised while importing
        raise PipelineSpecError(f"importing {module_name!r} raised {type(exc).__name__}: {one_line(exc)}; "
                                f"run python -c 'import {module_name}' to see the traceback") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PipelineSpecError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_pipeline(target: str):
    """``module:attr`` (attr a lab.Pipeline or a zero-argument factory returning one)."""
    obj = import_attr(target, "pipeline")
    if not isinstance(obj, Pipeline) and callable(obj):
        try:
            obj = obj()
        except PipelineSpecError:
            raise
        except Exception as exc:
            raise PipelineSpecError(f"calling {target}() raised {type(exc).__name__}: {one_line(exc)}; "
                                    "it must build a lab.Pipeline with no arguments") from exc
    if not isinstance(obj, Pipeline):
        raise PipelineSpecError(f"{target} is {a_noun(obj)}; expected a lab.Pipeline or a "
                                "zero-argument function returning one")
    return obj


def load_step(spec: str) -> Any:
    """``simulated:STEP_MS`` (a SimulatedDevice) or ``module:attr`` of a callable taking a batch."""
    kind, _, value = spec.partition(":")
    if kind != "simulated":
        step = import_attr(spec, "step")
        if not callable(step):
            raise PipelineSpecError(f"--step {spec} is {a_noun(step)}; expected a callable taking "
                                    "a batch, or simulated:STEP_MS")
        return step
    try:
        step_ms = float(value)
    except ValueError:
        step_ms = float("nan")
    if not 0 < step_ms <= 60_000:
        raise PipelineSpecError(f"--step {spec}: expected simulated:STEP_MS with a step of 0 to 60000 ms, "
                                "e.g. simulated:20")
    # Kernels of about the default length, with the default launch/kernel ratio (see device.py).
    kernels = max(1, round(step_ms * 1000 / DEFAULT_KERNEL_US))
    kernel_us = step_ms * 1000 / kernels
    return SimulatedDevice(kernels=kernels, kernel_us=kernel_us, name=f"simulated {step_ms:g} ms",
                           launch_us=kernel_us * DEFAULT_LAUNCH_US / DEFAULT_KERNEL_US)


def a_noun(obj: Any) -> str:
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def print_written(report: Path, result: Any, data: Path | None, t0: float) -> int:
    """Where the HTML report went, and the JSON (``result.to_json(data)``) when ``data`` is given; the time."""
    print(f"\nreport: {report.resolve()}")
    if data is not None:
        print(f"data:   {result.to_json(data).resolve()}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return EXIT_OK


def one_line(exc: BaseException, limit: int | None = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def report_dir(path: str | None) -> Path:
    """``path``, else $SPDL_LAB_REPORT_DIR, else ./spdl_lab_reports; made now, so that a run
    of minutes never ends unable to write its reports."""
    folder = Path(path or os.environ.get(ENV_REPORT_DIR) or DEFAULT_REPORT_DIR)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"cannot create the folder {folder}: {exc.strerror or exc}; choose another path") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write to {folder}: permission denied; choose another path")
    return folder


def output_path(path: str | None, default_name: str | None) -> Path | None:
    """Where a file goes: ``path``, else ``default_name`` in the report folder, else nowhere (None)."""
    if path is None:
        return None if default_name is None else report_dir(None) / default_name
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{out} is a folder; give a file name")
    report_dir(str(out.parent))
    return out


def count(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number from ``lo`` to ``hi``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if value < lo or (hi is not None and value > hi):
            limit = f" and <= {hi}" if hi is not None else ""
            raise argparse.ArgumentTypeError(f"expected a whole number >= {lo}{limit}, got {text!r}")
        return value
    return parse


def seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


#: Where reports go when no path is given, as the options' help says it.
REPORT_DIR_HELP = "$SPDL_LAB_REPORT_DIR or ./spdl_lab_reports"


def add_outputs(parser: argparse.ArgumentParser, html: tuple[str, ...], html_name: str, json_help: str) -> None:
    """The HTML report's option (``html``: its names; ``html_name`` in the report folder by default) and --json."""
    parser.add_argument(*html, default=None, metavar="PATH.html",
                        help=f"where the HTML report goes (default: {REPORT_DIR_HELP}, {html_name})")
    parser.add_argument("--json", default=None, metavar="PATH.json", help=json_help)


def stem(target: str) -> str:
    return target.replace(":", "-").replace("/", "_")


def progress_wanted(args: argparse.Namespace) -> bool:
    """Bars on a terminal, unless --quiet; none in logs and pipes (carriage returns would litter them)."""
    return not args.quiet and sys.stderr.isatty()


# -- spdl-lab report ------------------------------------------------------------------------------
def report(args: argparse.Namespace) -> int:
    """A saved diagnosis or comparison, a run's or a job's record, as one HTML file."""
    source = Path(args.file)
    out = Path(args.output) if args.output else source.with_suffix(".html")
    if not (source.is_dir() or source.is_file()):
        raise UsageError(f"{source}: no such file; give the .json that spdl-lab diagnose or "
                         "spdl-lab compare --json wrote, a run's .sqlite record, or a job's record folder")
    if source.is_file() and out.resolve() == source.resolve():
        raise UsageError(f"{out} would overwrite the file it is read from; name another file with -o")
    output_path(str(out), None)
    read = _report_job if source.is_dir() else _report_run if _is_record(source) else _report_saved
    text, path = read(source, out)
    print(f"{text}\n\nreport: {path.resolve()}")
    return EXIT_OK


def _is_record(path: Path) -> bool:
    """A run's record (SQLite) rather than a saved JSON: by its suffix or its first 16 bytes."""
    if path.suffix.lower() in (".sqlite", ".db"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def _report_saved(source: Path, out: Path) -> tuple[Any, Path]:
    """A Diagnosis or a Comparison, whichever the file's ``format`` says; strictly checked."""
    from spdl_lab._ui.report import write_comparison_report, write_diagnosis_report

    try:
        saved = read_any(source, (Diagnosis, Comparison), "Give a file written by spdl-lab "
                         "diagnose, spdl-lab compare --json, or .to_json(path)")
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror or exc}") from None
    except FileFormatError as exc:
        if exc.field:  # JSON of ours with a wrong field: the record hint would only distract
            raise
        raise FileFormatError(f"{exc} Or give a run's record (.sqlite, written by lab.publish or spdl-lab watch).",
                              source=exc.source, field=exc.field) from None
    if isinstance(saved, Comparison):
        title, note = f"spdl_lab comparison: {source.stem}", f"From {source.name}."
        return saved, write_comparison_report(saved, out, title=title, note=note)
    title = f"spdl_lab diagnosis: {source.stem}"
    return saved.summary(), write_diagnosis_report(saved, out, title=title)


def _report_run(source: Path, out: Path) -> tuple[str, Path]:
    """A published run's record (``lab.publish``, ``spdl-lab watch``)."""
    from spdl_lab._ui.run_report import read_run, run_steps, run_text, write_run_page

    meta, frames = read_run(source)  # read once: a running record grows between two reads
    step = run_steps(source, meta)
    path = write_run_page(meta, frames, out, title=f"spdl_lab run: {meta.get('name', source.stem)}", step=step)
    return run_text(meta, frames, step), path


def _report_job(folder: Path, out: Path) -> tuple[str, Path]:
    """A data-parallel job's record folder (``rank0.sqlite``, ...)."""
    from spdl_lab._ui.job_dashboard import write_job_report
    from spdl_lab._watch.job import JobSession

    try:
        job = JobSession.from_dir(folder)
    except SpdlLabError as exc:
        raise UsageError(str(exc)) from None
    table = job.summary().to_string(float_format=lambda x: f"{x:.3g}")
    text = (f"job {job.name}: {len(job.ranks)} ranks, {job.state}\n{table}\n\n"
            f"verdict: {job.verdict()}")
    return text, write_job_report(job, out)
