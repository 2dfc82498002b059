"""``lab.Tuning``: what a tuning measured and chose, as data (trials, log, best, code). The types
below are also the JSON file's description, checked by pydantic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import pandas as pd
from pydantic import Field, PlainValidator, with_config
from typing_extensions import TypedDict

from .._file_checks import RECORD, Flag, Meta, Name, Rate, Saved, Share, Text, integer, refuse, rows
from .._loader import Loader
from .._pipeline import MAX_CONCURRENCY, Pipeline
from .._views import view
from ..errors import FileFormatError, PipelineSpecError
from .search import Advice, Step, ratio_text
from .space import DATALOADER_KNOBS, TUNABLE_RUNNERS, WORKERS, Config, Trial

Runner = Literal[TUNABLE_RUNNERS]
Knobs = Annotated[dict[Name, integer(1, MAX_CONCURRENCY)], Field(max_length=1000)]  # {stage: threads}


class TuningFormatError(FileFormatError):
    """A tuning file (or a Tuning being written) does not fit the format; ``field`` is its JSON path."""


@with_config(RECORD)
class LoaderConfig(TypedDict):
    """A configuration as ``Tuning.best`` gives it."""

    runner: Runner
    concurrency: Knobs  # under process every stage runs in each worker
    options: Meta  # runner options, e.g. {"num_workers": 2} for process


@dataclass
class TrialRow:
    """A row of ``Tuning.trials``: one measured configuration, in the order measured."""

    __pydantic_config__ = RECORD

    runner: Runner
    concurrency: Knobs
    options: Meta
    batches_per_s: Rate  # median of the trial's windows
    batches_per_s_lo: Rate  # slowest and fastest window
    batches_per_s_hi: Rate
    spread: Rate  # (hi - lo) / median
    predicted_batches_per_s: Rate  # what the model predicted before measuring (NaN for the start)
    limit: Name  # what the model said limits it: a stage, "workers", "step" or "cpu"
    step_p50_ms: Rate
    data_wait_frac: Share
    cpu_percent: Rate  # this process and its children, 100 = one core
    train_gil_wait_frac: Share
    gil_wait_frac: Share
    move: Text  # how the tuner got here
    kept: Flag  # whether it became the best so far
    windows: integer(0, 10**6)
    started_s: Rate
    elapsed_s: Rate
    others_percent: Rate = math.nan  # other processes' CPU over its windows, 100 = one core
    restart_s: Rate = math.nan  # an epoch restart's extra seconds, charged to its batches (NaN: none)


TRIAL_COLUMNS = [f.name for f in fields(TrialRow)]  # of ``Tuning.trials``


def config_dict(config: Config, pipeline: Pipeline) -> LoaderConfig:
    """``{"runner", "concurrency", "options"}`` as ``Tuning.best`` gives it."""
    concurrency, options = dict(config.knobs), dict(config.options)
    if config.runner == "process":
        workers = concurrency.get(WORKERS, 1)
        options = {"num_workers": workers, **{k: v for k, v in options.items() if k != "num_workers"}}
        concurrency = {s.name: workers for s in pipeline.stages if s.kind == "map"}
    return LoaderConfig(runner=config.runner, concurrency=concurrency, options=options)


def loader_code(best: dict[str, Any], batches_per_s: float, speedup: float, from_dataloader: bool,
                advice: str = "") -> str:
    """Code that builds the loader ``best`` describes; for a DataLoader under ``process``, its keywords."""
    head = (f"# spdl_lab tune: {advice}" if advice.startswith("keep") else
            f"# spdl_lab tune: {best['runner']}, {batches_per_s:.3g} training batches/s, "
            f"{speedup:.2f}x the starting configuration (measured side by side)")
    options = best["options"]
    if best["runner"] == "process" and from_dataloader:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in options.items())
        return "\n".join([head, "# keep your DataLoader; change only these keyword arguments:",
                          f"dataloader_kwargs = dict({kwargs})",
                          "loader = torch.utils.data.DataLoader(dataset, batch_size=..., **dataloader_kwargs)"])
    lines = [head, "import spdl_lab as lab", ""]
    if from_dataloader:
        lines += ["p = lab.from_dataloader(dataloader)  # the same dataset, sampler and collate_fn"]
    knobs = best["concurrency"].items() if best["runner"] != "process" else ()
    expr = "p" + "".join(f".with_concurrency({name!r}, {n})" for name, n in knobs)
    args = [expr, f"runner={best['runner']!r}", *(f"{k}={v!r}" for k, v in options.items())]
    lines += ["loader = lab.Loader(", *(f"    {a}," for a in args), ")"]
    return "\n".join(lines)


@dataclass
class Tuning(Saved):
    """The result of ``lab.tune``: ``best``, ``trials``, ``log``, ``speedup``, ``code``, ``loader()``."""

    __pydantic_config__ = RECORD
    ERROR: ClassVar = TuningFormatError
    FIX: ClassVar = ("Only files written by Tuning.to_json can be read; run lab.tune again and save it with "
                     ".to_json(path)")
    MAX_BYTES: ClassVar = 20 * 2**20

    best: LoaderConfig
    start: LoaderConfig
    trials: Annotated[pd.DataFrame, rows(TrialRow, 10_000)]
    log: Annotated[list[Text], Field(max_length=10_000)]
    speedup: Rate  # best over start, median of side-by-side rounds
    speedup_lo: Rate
    speedup_hi: Rate
    budget_s: Rate
    elapsed_s: Rate
    cores: integer(1, 1 << 20)
    code: Text
    best_batches_per_s: Rate = math.nan  # the best's own trial, median of its windows
    source_is_dataloader: Flag = False
    advice: Text = ""  # "move to ...: ..." or "keep what you have: ...", with the ratio measured
    moved: Flag = True  # False: keep what you have (``best`` is ``start``)
    #: what made the measurement less than trustworthy (a busy machine, windows spread wide)
    warnings: Annotated[list[Text], Field(max_length=1000)] = field(default_factory=list)
    #: the fastest configuration measured other than the start, and its side-by-side ratio to it
    change: LoaderConfig | None = None
    change_speedup: Rate = math.nan
    change_speedup_lo: Rate = math.nan
    change_speedup_hi: Rate = math.nan
    others_before_percent: Rate = math.nan  # other processes' CPU before measuring, 100 = one core
    pipeline: Annotated[Pipeline | None, PlainValidator(
        lambda _: refuse((), "a tuning file holds no pipeline; pass it to Tuning.loader(p)"))] = field(
        default=None, repr=False)

    @classmethod
    def build(cls, *, pipeline: Pipeline, source_is_dataloader: bool, start: Config, best: Trial,
              steps: Sequence[Step], log: list[str],
              speedup: tuple[float, float, float], budget_s: float, elapsed_s: float, cores: int,
              advice: Advice, change: Trial | None = None,
              change_speedup: tuple[float, float, float] = (math.nan, math.nan, math.nan),
              others_before: float = math.nan) -> Tuning:
        best_d = config_dict(best.config, pipeline)
        return cls(best=best_d, start=config_dict(start, pipeline), trials=trials_frame(steps, pipeline), log=list(log),
                   speedup=speedup[0], speedup_lo=speedup[1], speedup_hi=speedup[2], budget_s=budget_s,
                   elapsed_s=elapsed_s, cores=cores,
                   code=loader_code(best_d, best.batches_per_s, speedup[0], source_is_dataloader,
                                    advice.sentence),
                   best_batches_per_s=best.batches_per_s, source_is_dataloader=source_is_dataloader,
                   advice=advice.sentence, moved=advice.move, warnings=list(advice.warnings),
                   change=config_dict(change.config, pipeline) if change is not None else None,
                   change_speedup=change_speedup[0], change_speedup_lo=change_speedup[1],
                   change_speedup_hi=change_speedup[2], others_before_percent=others_before,
                   pipeline=pipeline)

    def loader(self, pipeline: Pipeline | None = None, **loader_options: Any):
        """A ``lab.Loader`` running the best configuration (on ``pipeline``, default the tuned one)."""
        pipeline = pipeline if pipeline is not None else self.pipeline
        if not isinstance(pipeline, Pipeline):
            raise PipelineSpecError("Tuning.loader: this tuning was read from a file and has no pipeline; "
                                    "pass it: tuning.loader(p)")
        for name, n in self.best["concurrency"].items():
            if self.best["runner"] != "process":
                pipeline = pipeline.with_concurrency(name, n)
        return Loader(pipeline, runner=self.best["runner"], **{**self.best["options"], **loader_options})

    def plot(self) -> Any:
        """A Bokeh layout: measured (with each trial's window range) and predicted batches/s, trial by trial."""
        return view("tuning_plot")(self)

    def to_html(self, path: str | Path) -> Path:
        """A self-contained HTML report (Bokeh inline): the best, the code, the log, the trials."""
        return view("tuning_report")(self, path)

    def summary(self) -> str:
        """One line: the advice (move, or keep what you have, with the ratio measured) and the effort."""
        effort = f"{len(self.trials)} trials in {self.elapsed_s:.0f} s (budget {self.budget_s:.0f} s)"
        warned = f"; {len(self.warnings)} warning(s): no move recommended" if self.warnings and not self.moved else ""
        if self.advice and not self.moved:
            return f"{self.advice}; {effort}{warned}"
        best = self.best
        knobs = " ".join(f"{k}={v}" for k, v in best["concurrency"].items()) if best["runner"] != "process" \
            else " ".join(f"{k}={best['options'][k]}" for k in ("num_workers", *DATALOADER_KNOBS)
                          if k in best["options"])
        return (f"best: {best['runner']} {knobs}: {self.best_batches_per_s:.3g} batches/s, "
                f"{ratio_text(self.speedup, self.speedup_lo, self.speedup_hi)} the start side by side; {effort}")

    def __repr__(self) -> str:
        warnings = [f"  warning: {w}" for w in self.warnings]
        return "\n".join([f"Tuning({self.summary()})", *warnings, *(f"  {line}" for line in self.log)])

    def _repr_html_(self) -> str:
        return view("tuning_html")(self)

    def _saved_fields(self) -> dict[str, Any]:
        saved = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("trials", "pipeline")}
        return {**saved, "trials": self.trials[TRIAL_COLUMNS].to_dict(orient="records")}


def trials_frame(steps: Sequence[Step], pipeline: Pipeline) -> pd.DataFrame:
    """``Tuning.trials``: a row per measured configuration, in the order measured."""
    rows = []
    for step in steps:
        t, config = step.trial, config_dict(step.trial.config, pipeline)
        rows.append(asdict(TrialRow(
            runner=t.config.runner, concurrency=config["concurrency"], options=config["options"],
            batches_per_s=t.batches_per_s, batches_per_s_lo=t.lo, batches_per_s_hi=t.hi, spread=t.spread,
            predicted_batches_per_s=step.predicted, limit=step.limit, step_p50_ms=t.step_p50_ms,
            data_wait_frac=t.data_wait_frac, cpu_percent=t.cpu_percent, train_gil_wait_frac=t.train_gil_wait_frac,
            gil_wait_frac=t.gil_wait_frac, move=step.move.describe(), kept=step.kept, windows=len(t.rates),
            started_s=t.started_s, elapsed_s=t.elapsed_s, others_percent=t.others_percent, restart_s=t.restart_s)))
    return pd.DataFrame(rows, columns=TRIAL_COLUMNS)
