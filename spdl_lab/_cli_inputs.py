"""What the ``spdl-lab`` command reads (``module:attr`` targets, ``--step`` specs) and where it
writes; errors (``PipelineSpecError``, ``UsageError``: exit 2) say in one line what was wrong and
what to do."""

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
from ._pipeline import Pipeline
from ._training.device import DEFAULT_KERNEL_US, DEFAULT_LAUNCH_US, SimulatedDevice
from .errors import PipelineSpecError, UsageError

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

