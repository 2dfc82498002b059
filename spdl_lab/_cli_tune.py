"""``spdl-lab tune``: search a pipeline's runner and concurrency (``lab.tune``), or check DataLoader
advice in the unchanged script (``--script``); the trials as a table."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

from ._cli_inputs import (
    EXIT_OK,
    UsageError,
    load_pipeline,
    load_step,
    output_path,
    print_written,
    progress_wanted,
    stem,
)
from ._json import loads
from ._table import num, pct, spread, text_table
from ._tune import tune as run_tuner
from ._tune.space import DATALOADER_KNOBS, TUNABLE_RUNNERS

DEFAULT_BUDGET_S = 60.0  # ``--budget`` when none is given, as ``lab.tune``'s ``budget_s``


def tune(args: argparse.Namespace) -> int:
    """Tune the pipeline ``args.target`` names, or check DataLoader advice in ``--script``."""
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
    """Check DataLoader advice in the unchanged script: its own steps/s both ways, alternating."""
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
    twice = sorted({r for r in runners if runners.count(r) > 1})
    if twice:
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
