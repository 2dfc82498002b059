"""Diagnostic mode without a code change (the SPDL RFC): with ``SPDL_PIPELINE_DIAGNOSTIC_MODE=1``,
the first iteration of any ``lab.Loader`` or ``lab.run`` diagnoses the pipeline instead, writes
the reports, prints a summary and their paths, and exits with status 1."""

from __future__ import annotations

import datetime as dt
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from .._pipeline import Pipeline
from ..errors import PipelineSpecError
from .measure import DEFAULT_CONCURRENCY, DEFAULT_NUM_ITEMS, diagnose

ENV = "SPDL_PIPELINE_DIAGNOSTIC_MODE"
ENV_NUM_ITEMS = "SPDL_PIPELINE_DIAGNOSTIC_MODE_NUM_ITEMS"
ENV_CONCURRENCY = "SPDL_PIPELINE_DIAGNOSTIC_MODE_CONCURRENCY"  # e.g. "1,2,4"
ENV_REPORT_DIR = "SPDL_LAB_REPORT_DIR"
DEFAULT_REPORT_DIR = "spdl_lab_reports"
EXIT_STATUS = 1  # the diagnostic mode's (the CLI documents it too)


def enabled() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise PipelineSpecError(f"{ENV}={os.environ[ENV]!r} is not understood; set it to 1 (on) or 0 (off)")


def _counts(env: str, default: tuple[int, ...], expected: str, many: bool = True) -> tuple[int, ...]:
    """Whole numbers >= 1 from ``$env`` (comma-separated if ``many``); ``default`` when unset."""
    raw = os.environ.get(env, "").strip()
    parts = [p.strip() for p in raw.split(",")] if many else [raw]
    if raw and not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise PipelineSpecError(f"{env}={raw!r}: expected {expected}")
    return tuple(int(p) for p in parts) if raw else default


def write_reports(diagnosis, directory: str | os.PathLike | None = None, stem: str | None = None) -> tuple[Path, Path]:
    """Write ``<stem>.html`` and ``<stem>.json`` under ``directory``; returns both paths."""
    folder = Path(directory or os.environ.get(ENV_REPORT_DIR) or DEFAULT_REPORT_DIR)
    if stem is None:
        stem = f"diagnosis-{dt.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)
    return diagnosis.to_html(folder / f"{stem}.html"), diagnosis.to_json(folder / f"{stem}.json")


def run_diagnostic_mode(pipeline: Pipeline) -> NoReturn:
    """Diagnose ``pipeline``, write the reports, print where, and ``sys.exit(1)``."""
    (count,) = _counts(ENV_NUM_ITEMS, (DEFAULT_NUM_ITEMS,), "a whole number of inputs >= 1, e.g. 100",
                       many=False)
    levels = _counts(ENV_CONCURRENCY, DEFAULT_CONCURRENCY, "comma-separated thread counts, e.g. 1,2,4,8")
    print(f"spdl_lab: {ENV}=1: diagnosing the pipeline instead of running it "
          f"({count} inputs, concurrency {', '.join(map(str, levels))})", flush=True)
    diagnosis = diagnose(pipeline, levels, num_items=count)
    html, data = write_reports(diagnosis)
    print(diagnosis.summary())
    print(f"\nreport: {html.resolve()}\ndata:   {data.resolve()}", flush=True)
    print(f"spdl_lab: diagnostic mode ends the program (exit status {EXIT_STATUS}); unset {ENV} to train.",
          flush=True)
    sys.exit(EXIT_STATUS)


def start_hook(event: str, subject: Any) -> None:
    """The start hook (``spdl_lab._runs.StartHook``): with the mode on, a pipeline about to run
    (``"pipeline"``, or an SPDL builder or config: ``"spdl"``) is diagnosed instead."""
    if event not in ("pipeline", "spdl") or not enabled():
        return
    if event == "spdl":
        from .._integrations.spdl import from_spdl

        try:
            subject = from_spdl(subject)
        except PipelineSpecError as exc:
            raise PipelineSpecError(
                f"{ENV}=1: spdl_lab diagnoses an SPDL pipeline through lab.from_spdl, which refused this "
                f"one ({exc}). Unset {ENV}, or leave spdl_lab out and let SPDL's own diagnostic mode "
                "profile it."
            ) from exc
    run_diagnostic_mode(subject)
