"""``spdl-lab tune TARGET``: ``lab.tune`` from the command line; in the terminal the trials as a
table, the tuner's log and the code to paste, and an HTML report (JSON with ``--json``)."""

from __future__ import annotations

import argparse
import math
import time

import pandas as pd

from ._cli_inputs import (
    EXIT_OK,
    UsageError,
    add_outputs,
    load_pipeline,
    load_step,
    output_path,
    seconds,
)
from ._table import num, pct, spread, text_table
from ._tune import tune as run_tuner
from ._tune.space import DATALOADER_KNOBS, TUNABLE_RUNNERS

__all__ = ["DEFAULT_BUDGET_S", "add_arguments", "trials_table", "tune"]

#: ``--budget`` when none is given, as ``lab.tune``'s ``budget_s``.
DEFAULT_BUDGET_S = 60.0


def tune(args: argparse.Namespace, *, progress: bool, stem: str) -> int:
    """Tune the pipeline named by ``args.target`` for ``args.step``; print and write what it found."""
    pipeline, step = load_pipeline(args.target), load_step(args.step)
    runners = _runners(args.runners)
    if args.start is not None and args.start not in runners:
        raise UsageError(f"--start {args.start} is not among --runners {' '.join(runners)}; "
                         "add it to --runners or start from one of them")
    # Checked before minutes of measuring, so that a bad path never throws the tuning away.
    html, data = output_path(args.output, f"tune-{stem}.html"), output_path(args.json, None)
    shown = f"{args.step}" + (f" ({step!r})" if args.step.startswith("simulated:") else "")
    print(f"pipeline: {args.target}: {pipeline!r}\nstep: {shown}\n"
          f"runners: {' '.join(runners)}; budget {args.budget:g} s\n", flush=True)
    t0 = time.perf_counter()
    tuning = run_tuner(pipeline, step, runners=runners, budget_s=args.budget, start=args.start,
                       progress=progress)
    warnings = [f"warning: {w}" for w in tuning.warnings]
    print(tuning.summary(), *warnings, "", trials_table(tuning.trials), "", *tuning.log, "",
          f"code (p is the pipeline {args.target} names):", tuning.code, sep="\n")
    print(f"\nreport: {tuning.to_html(html).resolve()}")
    if data is not None:
        print(f"data:   {tuning.to_json(data).resolve()}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return EXIT_OK


def _runners(groups: list[list[str]] | None) -> list[str]:
    """``--runners a b`` and ``--runners a,b`` alike, each runner once."""
    runners = [r for group in groups for r in group] if groups else list(TUNABLE_RUNNERS)
    twice = sorted({r for r in runners if runners.count(r) > 1})
    if twice:
        raise UsageError(f"--runners names {', '.join(twice)} more than once; name each runner once")
    return runners


def _runner_names(text: str) -> list[str]:
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


# -- the table -----------------------------------------------------------------------------------

def _concurrency(row: pd.Series) -> str:
    if row["runner"] == "process":  # every stage runs in each worker: the pool is the knob
        knobs = [f"{k}={row['options'][k]}" for k in DATALOADER_KNOBS if k in row["options"]]
        return " ".join([f"workers={row['options'].get('num_workers')}", *knobs])
    return " ".join(f"{name}={n}" for name, n in row["concurrency"].items())


def trials_table(trials: pd.DataFrame) -> str:
    """``Tuning.trials`` as fixed-width text, one line per trial in the order measured: text
    columns aligned left, numbers right."""
    headings = ["runner", "concurrency", "batches/s [lo-hi]", "predicted", "step p50 ms", "data wait", "CPU %",
                "others CPU %", "move", "kept"]
    rows = [[str(row["runner"]), _concurrency(row), spread(row["batches_per_s"], row["batches_per_s_lo"],
                                                           row["batches_per_s_hi"]),
             num(row["predicted_batches_per_s"]), num(row["step_p50_ms"], ".1f"), pct(row["data_wait_frac"]),
             num(row["cpu_percent"], ".0f"), num(row.get("others_percent", math.nan), ".0f"), str(row["move"]),
             "kept" if row["kept"] else "-"]
            for _, row in trials.iterrows()]
    return "\n".join(text_table(headings, rows, left=(0, 1, 8, 9)))


# -- the options -------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``spdl-lab tune`` after TARGET and --step."""
    parser.add_argument("--budget", type=seconds, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                        help=f"wall time for the whole tuning, the final side-by-side check included "
                             f"(default {DEFAULT_BUDGET_S:g})")
    parser.add_argument("--runners", type=_runner_names, nargs="+", default=None, metavar="RUNNER",
                        help=f"runners to choose between, by spaces or commas "
                             f"(default: {','.join(TUNABLE_RUNNERS)})")
    parser.add_argument("--start", choices=TUNABLE_RUNNERS, default=None, metavar="RUNNER",
                        help="the runner to start from, at the pipeline's own concurrency "
                             "(default: the first of --runners)")
    add_outputs(parser, ("-o", "--output"), "tune-MODULE-ATTR.html",
                "also save the tuning as JSON (lab.Tuning.from_json reads it)")
