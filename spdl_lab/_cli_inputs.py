"""What the ``spdl-lab`` command reads (``module:attr`` targets, ``--step`` specs, the saved files
``spdl-lab report`` renders) and where it writes, and its ``report`` and ``tune`` commands; errors
(``PipelineSpecError``, ``UsageError``: exit 2) say in one line what was wrong and what to do."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from ._diagnose.env_mode import DEFAULT_REPORT_DIR, ENV_REPORT_DIR
from ._diagnose.result import Diagnosis
from ._experiments.compare import Comparison
from ._file_checks import read_any
from ._json import loads
from ._pipeline import Pipeline
from ._table import num, pct, spread, text_table
from ._training.device import DEFAULT_KERNEL_US, DEFAULT_LAUNCH_US, SimulatedDevice
from ._tune import tune as run_tuner
from ._tune.space import DATALOADER_KNOBS, TUNABLE_RUNNERS
from .errors import FileFormatError, PipelineSpecError, SpdlLabError, UsageError

#: The command's exit statuses (``cli.EXIT_CODES`` says what each means; 130, interrupted, is _startup's).
EXIT_OK, EXIT_USAGE, EXIT_FAILED = 0, 2, 3


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


def _number(kind: type, ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: a ``kind`` that ``ok`` accepts, else an error saying ``expected``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


def count(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number from ``lo`` to ``hi``."""
    limit = f" and <= {hi}" if hi is not None else ""
    return _number(int, lambda value: value >= lo and (hi is None or value <= hi),
                   f"a whole number >= {lo}{limit}")


#: An argparse type: a number of seconds > 0.
seconds = _number(float, lambda value: 0 < value < math.inf, "a number of seconds > 0")


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
    from spdl_lab._ui.run_report import report_run

    read = _report_job if source.is_dir() else report_run if _is_record(source) else _report_saved
    text, path = read(source, out)
    print(f"{text}\n\nreport: {path.resolve()}")
    return EXIT_OK


def _is_record(path: Path) -> bool:
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


def _report_job(folder: Path, out: Path) -> tuple[str, Path]:
    from spdl_lab._watch.job import JobSession

    try:
        job = JobSession.from_dir(folder)
    except SpdlLabError as exc:
        raise UsageError(str(exc)) from None
    table = job.summary().to_string(float_format=lambda x: f"{x:.3g}")
    text = (f"job {job.name}: {len(job.ranks)} ranks, {job.state}\n{table}\n\n"
            f"verdict: {job.verdict()}")
    return text, job.to_html(out)


# -- spdl-lab tune --------------------------------------------------------------------------------
DEFAULT_BUDGET_S = 60.0  # ``--budget`` when none is given, as ``lab.tune``'s ``budget_s``


def tune(args: argparse.Namespace) -> int:
    if args.script is not None:
        return tune_script(args)
    if args.target is None:
        raise UsageError("give TARGET (module:attr naming a lab.Pipeline) to tune, or --script train.py "
                         "[args...] with --set KEY=VALUE to check DataLoader advice in the job itself")
    pipeline, step = load_pipeline(args.target), load_step(args.step)
    runners = _runners(args.runners)
    if args.start is not None and args.start not in runners:
        raise UsageError(f"--start {args.start} is not among --runners {' '.join(runners)}; "
                         "add it to --runners or start from one of them")
    # Checked before minutes of measuring, so that a bad path never throws the tuning away.
    html = output_path(args.output, f"tune-{stem(args.target)}.html")
    data = output_path(args.json, None)
    shown = f"{args.step}" + (f" ({step!r})" if args.step.startswith("simulated:") else "")
    print(f"pipeline: {args.target}: {pipeline!r}\nstep: {shown}\n"
          f"runners: {' '.join(runners)}; budget {args.budget:g} s\n", flush=True)
    t0 = time.perf_counter()
    tuning = run_tuner(pipeline, step, runners=runners, budget_s=args.budget, start=args.start,
                       progress=progress_wanted(args))
    warnings = [f"warning: {w}" for w in tuning.warnings]
    print(tuning.summary(), *warnings, "", trials_table(tuning.trials), "", *tuning.log, "",
          f"code (p is the pipeline {args.target} names):", tuning.code, sep="\n")
    return print_written(tuning.to_html(html), tuning, data, t0)


def tune_script(args: argparse.Namespace) -> int:
    from ._watch.command import check_script

    if args.target is not None:
        raise UsageError(f"--script checks advice in a script; TARGET {args.target!r} is for tuning a "
                         "pipeline: give one or the other")
    advice = {**advice_file(args.advice), **dict(args.set or [])}
    command = list(args.script)
    if command and command[0].endswith(".py"):
        command = [sys.executable, *command]
    print(f"script: {' '.join(command)}", f"advice: {json.dumps(advice)} (as $SPDL_LAB_DATALOADER_KWARGS)",
          f"{args.rounds} runs each way, alternating, {args.warmup} warm-up steps then {args.steps} counted",
          "", sep="\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="spdl_lab_tune_script_") as workdir:
        print(check_script(command, advice, Path(workdir), steps=args.steps, warmup=args.warmup,
                           rounds=args.rounds, timeout_s=args.timeout))
    return EXIT_OK


def setting(text: str) -> tuple[str, Any]:
    """One --set KEY=VALUE: VALUE as JSON (4, true, null), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (a DataLoader keyword argument), got {text!r}")
    try:
        return key.strip(), loads(value)
    except ValueError:
        return key.strip(), value


def advice_file(path: str | None) -> dict[str, Any]:
    """The DataLoader keyword arguments of a saved tuning's best configuration."""
    if path is None:
        return {}
    from ._tune.result import Tuning

    if not Path(path).is_file():
        raise UsageError(f"--advice {path}: no such file; give what spdl-lab tune --json or Tuning.to_json wrote")
    best = Tuning.from_json(path).best
    if best["runner"] != "process":
        raise UsageError(f"the tuning in {path} advises the {best['runner']!r} runner, which a script's "
                         "DataLoader cannot take: use lab.from_dataloader in the script, or check "
                         "DataLoader arguments with --set")
    return dict(best["options"])


def _runners(groups: list[list[str]] | None) -> list[str]:
    """``--runners a b`` and ``--runners a,b`` alike, each runner once."""
    runners = [r for group in groups for r in group] if groups else list(TUNABLE_RUNNERS)
    if twice := sorted({r for r in runners if runners.count(r) > 1}):
        raise UsageError(f"--runners names {', '.join(twice)} more than once; name each runner once")
    return runners


def runner_names(text: str) -> list[str]:
    """One --runners value: a runner, or several separated by commas."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in TUNABLE_RUNNERS:
            why = " ('cache' replays batches: it is the headspace, not a way to load)" if name == "cache" else ""
            raise argparse.ArgumentTypeError(
                f"unknown runner {name!r}{why}; choose from {', '.join(TUNABLE_RUNNERS)}")
    if not names:
        raise argparse.ArgumentTypeError(f"expected runner names, got {text!r}")
    return names


def _concurrency(row: pd.Series) -> str:
    if row["runner"] == "process":  # every stage runs in each worker: the pool is the knob
        knobs = [f"{k}={row['options'][k]}" for k in DATALOADER_KNOBS if k in row["options"]]
        return " ".join([f"workers={row['options'].get('num_workers')}", *knobs])
    return " ".join(f"{name}={n}" for name, n in row["concurrency"].items())


def trials_table(trials: pd.DataFrame) -> str:
    """``Tuning.trials`` as fixed-width text, a line per trial in the order measured."""
    headings = ["runner", "concurrency", "batches/s [lo-hi]", "predicted", "step p50 ms", "data wait", "CPU %",
                "others CPU %", "move", "kept"]
    rows = [[str(row["runner"]), _concurrency(row), spread(row["batches_per_s"], row["batches_per_s_lo"],
                                                           row["batches_per_s_hi"]),
             num(row["predicted_batches_per_s"]), num(row["step_p50_ms"], ".1f"), pct(row["data_wait_frac"]),
             num(row["cpu_percent"], ".0f"), num(row.get("others_percent", math.nan), ".0f"), str(row["move"]),
             "kept" if row["kept"] else "-"]
            for _, row in trials.iterrows()]
    return "\n".join(text_table(headings, rows, left=(0, 1, 8, 9)))
