"""A Tuning to and from plain JSON.

Reading is strict and executes nothing: the schema below (``TuningFile``) checks
every field (types, ranges, unknown keys) before a Tuning is built, and the
error names the field's JSON path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import pandas as pd

from ..errors import FileFormatError
from ..file_checks import (
    MAX_NAME,
    MAX_TEXT,
    Checker,
    Meta,
    Record,
    at_most,
    choice,
    dump_document,
    integer,
    load_document,
    number,
    plain,
    string,
)
from ..pipeline import MAX_CONCURRENCY
from .result import TRIAL_COLUMNS, Tuning
from .space import TUNABLE_RUNNERS

__all__ = ["TuningFormatError", "read_json", "write_json"]

FORMAT, VERSION = "spdl_lab.tuning", 1
MAX_FILE_BYTES = 20 * 2**20
MAX_TRIALS, MAX_LOG, MAX_STAGES = 10_000, 10_000, 1000


class TuningFormatError(FileFormatError):
    """A tuning file (or a Tuning being written) does not fit the format; ``field`` is its JSON path."""


class _Checker(Checker):
    noun = "tuning"
    read_fix = "Only files written by Tuning.to_json can be read; run lab.tune again and save it with .to_json(path)"
    write_fix = "Correct that field of the Tuning"
    error = TuningFormatError


Name, Text = string(MAX_NAME), string(MAX_TEXT)
Rate, Share, Seconds = number(0), number(0, 1.5), number(0)
Runner = choice(*TUNABLE_RUNNERS)
Concurrency = integer(1, MAX_CONCURRENCY)
Knobs = Annotated[dict[Name, Concurrency], at_most(MAX_STAGES, "stages")]


class ConfigRecord(Record):
    runner: Runner
    concurrency: Knobs
    options: Meta


class TrialRecord(Record):
    runner: Runner
    concurrency: Knobs
    options: Meta
    batches_per_s: Rate
    batches_per_s_lo: Rate
    batches_per_s_hi: Rate
    spread: Rate
    predicted_batches_per_s: Rate
    limit: Name
    step_p50_ms: Rate
    data_wait_frac: Share
    cpu_percent: Rate
    train_gil_wait_frac: Share
    gil_wait_frac: Share
    move: Text
    kept: bool
    windows: integer(0, 10**6)
    started_s: Seconds
    elapsed_s: Seconds


class TuningFile(Record):
    format: Literal[FORMAT]
    version: Literal[1]
    best: ConfigRecord
    start: ConfigRecord
    best_batches_per_s: Rate
    speedup: Rate
    speedup_lo: Rate
    speedup_hi: Rate
    budget_s: Seconds
    elapsed_s: Seconds
    cores: integer(1, 1 << 20)
    code: Text
    source_is_dataloader: bool
    log: Annotated[list[Text], at_most(MAX_LOG, "log lines")]
    trials: Annotated[list[TrialRecord], at_most(MAX_TRIALS, "trials")]


assert list(TrialRecord.model_fields) == TRIAL_COLUMNS


def _encode(t: Tuning) -> dict[str, Any]:
    return plain({"format": FORMAT, "version": VERSION, "best": t.best, "start": t.start,
                  "best_batches_per_s": t.best_batches_per_s, "speedup": t.speedup, "speedup_lo": t.speedup_lo,
                  "speedup_hi": t.speedup_hi, "budget_s": t.budget_s, "elapsed_s": t.elapsed_s, "cores": t.cores,
                  "code": t.code, "source_is_dataloader": t.source_is_dataloader, "log": list(t.log),
                  "trials": t.trials[TRIAL_COLUMNS].to_dict(orient="records")})


def _read(doc: dict[str, Any], checker: _Checker) -> Tuning:
    checker.check_header(doc, FORMAT, VERSION)
    file = checker.validate(TuningFile, doc)
    trials = pd.DataFrame([dict(r) for r in file.trials], columns=TRIAL_COLUMNS)
    return Tuning(best=dict(file.best), start=dict(file.start), trials=trials, log=list(file.log),
                  speedup=file.speedup, speedup_lo=file.speedup_lo, speedup_hi=file.speedup_hi,
                  budget_s=file.budget_s, elapsed_s=file.elapsed_s, cores=file.cores, code=file.code,
                  best_batches_per_s=file.best_batches_per_s, source_is_dataloader=file.source_is_dataloader)


def write_json(tuning: Tuning, path: str | Path) -> Path:
    """Write ``tuning`` as plain JSON (checked against the reader's rules first); return the path."""
    path = Path(path)
    doc = _encode(tuning)
    _read(doc, _Checker(path, writing=True))
    return dump_document(doc, path)


def read_json(path: str | Path) -> Tuning:
    """Read and validate a file written by ``write_json``; raise TuningFormatError if it does not fit."""
    path = Path(path)
    return _read(load_document(path, _Checker(path), MAX_FILE_BYTES), _Checker(path))
