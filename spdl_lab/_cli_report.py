"""``spdl-lab report``: a saved diagnosis or comparison, a run's record, or a job's record folder,
as one self-contained HTML file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ._cli_inputs import EXIT_OK, UsageError, output_path
from ._diagnose.result import Diagnosis
from ._experiments.compare import Comparison
from ._file_checks import read_any
from .errors import FileFormatError, SpdlLabError


def report(args: argparse.Namespace) -> int:
    """A saved diagnosis or comparison, a run's or a job's record, as one HTML file."""
    source = Path(args.file)
    out = Path(args.output) if args.output else source.with_suffix(".html")
    if source.is_dir():
        text, path = _report_job(source, out)
    elif not source.is_file():
        raise UsageError(f"{source}: no such file; give the .json that spdl-lab diagnose or "
                         "spdl-lab compare --json wrote, a run's .sqlite record, or a job's record folder")
    elif out.resolve() == source.resolve():
        raise UsageError(f"{out} would overwrite the file it is read from; name another file with -o")
    else:
        output_path(str(out), None)
        text, path = (_report_run if _is_record(source) else _report_saved)(source, out)
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

    output_path(str(out), None)
    try:
        job = JobSession.from_dir(folder)
    except SpdlLabError as exc:
        raise UsageError(str(exc)) from None
    table = job.summary().to_string(float_format=lambda x: f"{x:.3g}")
    text = (f"job {job.name}: {len(job.ranks)} ranks, {job.state}\n{table}\n\n"
            f"verdict: {job.verdict()}")
    return text, write_job_report(job, out)
