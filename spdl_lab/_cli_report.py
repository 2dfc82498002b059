"""``spdl-lab report FILE``: a saved diagnosis or comparison (JSON), a run's record (SQLite, by
``lab.publish`` or ``spdl-lab watch``), or a data-parallel job's record folder (a record per
rank), as one self-contained HTML file."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._cli_inputs import EXIT_OK, UsageError, output_path, read_saved
from ._experiments.compare import Comparison
from .errors import FileFormatError, SpdlLabError

__all__ = ["RECORD_SUFFIXES", "report"]


def report(args: argparse.Namespace) -> int:
    """A saved diagnosis or comparison (JSON), or a run's record (SQLite), as one HTML file."""
    from spdl_lab._ui.diagnosis_report import write_diagnosis_report
    from spdl_lab._ui.report import write_comparison_report

    source = Path(args.file)
    if source.is_dir():
        return _report_job(source, Path(args.output) if args.output else source.with_suffix(".html"))
    if not source.is_file():
        raise UsageError(f"{source}: no such file; give the .json that spdl-lab diagnose or "
                         "spdl-lab compare --json wrote, a run's .sqlite record, or a job's record folder")
    out = Path(args.output) if args.output else source.with_suffix(".html")
    if out.resolve() == source.resolve():
        raise UsageError(f"{out} would overwrite the file it is read from; name another file with -o")
    output_path(str(out), None)
    if _is_record(source):
        return _report_run(source, out)
    try:
        saved = read_saved(source)
    except FileFormatError as exc:
        if exc.field:  # JSON of ours with a wrong field: the record hint would only distract
            raise
        raise FileFormatError(f"{exc} Or give a run's record (.sqlite, written by lab.publish or spdl-lab watch).",
                              source=exc.source, field=exc.field) from None
    if isinstance(saved, Comparison):
        note = f"From {source.name}."
        path = write_comparison_report(saved, out, title=f"spdl_lab comparison: {source.stem}", note=note)
    else:
        path = write_diagnosis_report(saved, out, title=f"spdl_lab diagnosis: {source.stem}")
    print(saved if isinstance(saved, Comparison) else saved.summary())
    print(f"\nreport: {path.resolve()}")
    return EXIT_OK


#: Suffixes of run records; a file with SQLite's header is read as a record whatever its name.
RECORD_SUFFIXES = (".sqlite", ".db")


def _is_record(path: Path) -> bool:
    """A run's record (SQLite) rather than a saved JSON: by its suffix or its first 16 bytes."""
    if path.suffix.lower() in RECORD_SUFFIXES:
        return True
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def _report_run(source: Path, out: Path) -> int:
    """A published run's record (``lab.publish``, ``spdl-lab watch``) as one HTML file."""
    from spdl_lab._ui.run_report import read_run, run_steps, run_text, write_run_page

    meta, frames = read_run(source)  # read once: a running record grows between two reads
    step = run_steps(source, meta)
    path = write_run_page(meta, frames, out, title=f"spdl_lab run: {meta.get('name', source.stem)}", step=step)
    print(run_text(meta, frames, step))
    print(f"\nreport: {path.resolve()}")
    return EXIT_OK


def _report_job(folder: Path, out: Path) -> int:
    """A data-parallel job's record folder (``rank0.sqlite``, ...) as one HTML file."""
    from spdl_lab._ui.job_report import write_job_report
    from spdl_lab._watch.job import JobSession

    output_path(str(out), None)
    try:
        job = JobSession.from_dir(folder)
    except SpdlLabError as exc:
        raise UsageError(str(exc)) from None
    path = write_job_report(job, out)
    print(f"job {job.name}: {len(job.ranks)} ranks, {job.state}")
    print(job.summary().to_string(float_format=lambda x: f"{x:.3g}"))
    print(f"\nverdict: {job.verdict()}")
    print(f"\nreport: {path.resolve()}")
    return EXIT_OK
