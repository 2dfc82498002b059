"""The ``spdl-lab`` command (also ``python -m spdl_lab``): info, demo, compare, diagnose, tune, watch, report.

Every subcommand has ``--help`` with an example. Exit status:

  0    done
  1    diagnostic mode ended the program: SPDL_PIPELINE_DIAGNOSTIC_MODE=1 was set, so the
       first Loader or lab.run diagnosed the pipeline, wrote its reports and exited
  2    usage error: a bad option, module:attr, file or value; one line on stderr says
       what was wrong and what to do
  3    the experiment failed: a stage or the step raised, or a runner died (traceback on stderr)
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

import spdl_lab as lab

from ._cli_inputs import (
    DEFAULT_BUDGET_S,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    REPORT_DIR_HELP,
    UsageError,
    add_outputs,
    count,
    load_pipeline,
    load_step,
    one_line,
    output_path,
    print_written,
    report,
    report_dir,
    seconds,
    trials_table,
)
from ._cli_inputs import progress_wanted as _progress
from ._cli_inputs import runner_names as _runner_names
from ._cli_inputs import setting as _setting
from ._cli_inputs import stem as _stem
from ._cli_inputs import tune as _tune
from ._diagnose.env_mode import DEFAULT_REPORT_DIR, write_reports
from ._diagnose.measure import diagnose
from ._experiments.compare import DEFAULT_REPEATS, DEFAULT_WARMUP, compare
from ._interpreter import describe
from ._pipeline import MAX_CONCURRENCY
from ._runners import LOCAL_RUNNERS, RUNNERS
from ._startup import EXIT_INTERRUPTED, import_safe_interrupts, interrupt_taken
from ._tune.space import TUNABLE_RUNNERS
from ._watch.command import kill_all, run_watched
from .errors import FileFormatError, PipelineSpecError, in_chain

__all__ = ["DEFAULT_BUDGET_S", "EXIT_CODES", "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser",
           "main", "trials_table"]

#: ``compare --step`` when none is given: a short simulated GPU step, so loading dominates.
DEFAULT_STEP = "simulated:20"
#: The exit codes as ``spdl-lab --help`` lists them; the module docstring says the same.
EXIT_CODES = __doc__[__doc__.index("Exit status:"):]


def _info(_: argparse.Namespace) -> int:
    print("\n".join(describe().lines(lab.__version__, lab.RUNNERS)))
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    images = args.workload == "images"
    html = output_path(args.report, "demo-images.html" if images else "demo.html")
    data = output_path(args.json, None)
    if images:
        # Enough batches for every round: (warm-up x rounds + steps) x batch size, in passes over 512 files.
        batches = (args.repeats or 5) * args.warmup + args.steps
        pipeline, step = lab.workloads.images(n=512, crop=128, batch_size=16, epochs=math.ceil(batches * 16 / 512))
    else:
        pipeline, step = lab.workloads.noisy_neighbour()
    print(f"{'images' if images else 'noisy neighbour'}: {pipeline!r}\nstep: {step!r}\n")
    title = "JPEG images" if images else "the noisy neighbour"
    return _run_comparison(args, pipeline, step, html, data, f"spdl_lab demo: {title}")


def _compare(args: argparse.Namespace) -> int:
    pipeline, step = load_pipeline(args.target), load_step(args.step)
    stem = "compare-" + _stem(args.target)
    html, data = output_path(args.report, f"{stem}.html"), output_path(args.json, f"{stem}.json")
    shown = f"{args.step}" + (f" ({step!r})" if args.step.startswith("simulated:") else "")
    print(f"pipeline: {args.target}: {pipeline!r}\nstep: {shown}\n")
    return _run_comparison(args, pipeline, step, html, data, f"spdl_lab comparison: {args.target}")


def _run_comparison(args: argparse.Namespace, pipeline: Any, step: Any, html: Path,
                    data: Path | None, title: str) -> int:
    from spdl_lab._ui.report import write_comparison_report

    options = {"process": {"num_workers": args.num_workers}} if args.num_workers else {}
    t0 = time.perf_counter()
    cmp = compare(pipeline, step=step, runners=args.runners, steps=args.steps, warmup=args.warmup,
                  repeats=args.repeats, runner_options=options, timeout=args.timeout,
                  progress=_progress(args))
    print(cmp)  # the table (100 columns at most), ratios to cache with their spread, then the warnings
    return print_written(write_comparison_report(cmp, html, title=title), cmp, data, t0)


def _diagnose(args: argparse.Namespace) -> int:
    pipeline = load_pipeline(args.target)
    folder = report_dir(args.report_dir)
    diagnosis = diagnose(pipeline, concurrency=args.concurrency, num_items=args.num_items,
                         processes=not args.no_processes, progress=_progress(args))
    html, data = write_reports(diagnosis, folder, stem=_stem(args.target))
    print(diagnosis.summary(), f"\nreport: {html.resolve()}\ndata:   {data.resolve()}", sep="\n")
    failed = [s for s in diagnosis.stages.values() if s.status == "failed"]
    for stage in failed:  # its traceback, where a failed experiment's goes
        print(f"\nstage {stage.name!r} {stage.evidence}:\n{stage.error or ''}", file=sys.stderr)
    if failed:
        print(f"spdl-lab diagnose: failed: {len(failed)} stage(s) raised: "
              f"{', '.join(repr(s.name) for s in failed)}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


#: The target of the --help examples, whose file names derive from it as the commands' do.
EXAMPLE_TARGET = "mypkg.data:make_pipeline"
EXAMPLE_REPORT = f"{DEFAULT_REPORT_DIR}/{_stem(EXAMPLE_TARGET)}.json"


def _writes(stem: str, suffixes: tuple[str, ...] = (".html", ".json")) -> str:
    return f"\n  (writes {' and '.join(f'{DEFAULT_REPORT_DIR}/{stem}{s}' for s in suffixes)})"


def _subcommand(sub: Any, name: str, run: Any, summary: str, description: str, example: str,
                runs: bool = False) -> argparse.ArgumentParser:
    """``runs``: the command runs a pipeline, so it may start worker processes and shows a bar."""
    parser = sub.add_parser(name, help=summary, description=description, epilog=f"example:\n  {example}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(run=run, runs_pipeline=runs)
    if runs:
        parser.add_argument("-q", "--quiet", action="store_true",
                            help="no progress bar (bars show only when stderr is a terminal)")
    return parser


def _comparison_options(parser: argparse.ArgumentParser, steps: int, num_workers: int | None) -> None:
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(LOCAL_RUNNERS), metavar="RUNNER",
                        help=f"runners to compare (default: {' '.join(LOCAL_RUNNERS)}; "
                             f"also {' '.join(r for r in RUNNERS if r not in LOCAL_RUNNERS)}, "
                             "which starts a Ray instance)")
    parser.add_argument("--steps", type=count(1), default=steps, metavar="N",
                        help=f"measured steps per runner, over all rounds (default {steps})")
    parser.add_argument("--warmup", type=count(0), default=DEFAULT_WARMUP, metavar="N",  # the API's default too
                        help=f"warm-up steps at the start of each runner's window in each round, "
                             f"not measured (default {DEFAULT_WARMUP})")
    parser.add_argument("--repeats", type=count(1), default=None, metavar="N",
                        help=f"interleaved rounds: each runner gets one window per round, and its "
                             f"batches/s is the median of its rounds (default {DEFAULT_REPEATS}, "
                             f"or --steps when fewer)")
    parser.add_argument("--num-workers", type=count(1), default=num_workers, metavar="N",
                        help="DataLoader workers for the 'process' runner"
                             + (f" (default {num_workers})" if num_workers else " (default: the runner's, 2)"))
    parser.add_argument("--timeout", type=seconds, default=None, metavar="SECONDS",
                        help="give up on a runner that takes longer than this, all its rounds together (exit 3)")


def _target(parser: argparse.ArgumentParser, optional: str = "", step: bool = True) -> None:
    parser.add_argument("target", metavar="TARGET", nargs="?" if optional else None,
                        help=f"module:attr naming a lab.Pipeline or a zero-argument factory{optional}")
    if step:
        parser.add_argument("--step", default=DEFAULT_STEP, metavar="STEP",
                            help="module:attr of a callable taking a batch, or simulated:STEP_MS, "
                                 "a lab.SimulatedDevice whose step takes STEP_MS of GPU time "
                                 f"(default {DEFAULT_STEP})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spdl-lab", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="spdl_lab: a lab bench for data loading in PyTorch training. Run a pipeline under\n"
                    "several parallelism models, measure where the time goes, write reports.",
        epilog="examples:\n  spdl-lab info\n  spdl-lab compare mypkg.data:make_pipeline --step simulated:20\n"
               "  spdl-lab diagnose mypkg.data:make_pipeline --concurrency 1 2 4 8\n"
               "  spdl-lab tune mypkg.data:make_pipeline --step simulated:20 --budget 60\n"
               f"  spdl-lab report {EXAMPLE_REPORT}\n\n" + EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {lab.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _subcommand(sub, "info", _info, "interpreter, GIL, cores, torch and CUDA",
                "Print the interpreter, whether the GIL is on, the CPU cores, torch and CUDA,\n"
                "and the runners this spdl_lab has.", "spdl-lab info")

    demo = _subcommand(
        sub, "demo", _demo, "compare every runner on the noisy-neighbour or the image workload; write an HTML report",
        "The parallelism study from the field notes: the noisy-neighbour workload (a\n"
        "GIL-holding decode stage beside a simulated GPU step), or --workload images (JPEG\n"
        "files made on this machine, PIL decode and augmentation, a small conv net step on\n"
        "CPU), under every runner; a table and ratios to cache (the headspace) in the\n"
        "terminal, and an HTML report.",
        "spdl-lab demo --workload images --steps 60 --runners thread subprocess-threads cache", runs=True)
    demo.add_argument("--workload", choices=("noisy-neighbour", "images"), default="noisy-neighbour",
                      help="which workload (default: noisy-neighbour)")
    _comparison_options(demo, steps=120, num_workers=2)
    add_outputs(demo, ("--report",), "demo.html", "also save the comparison as JSON (spdl-lab report renders it again)")

    cmp = _subcommand(
        sub, "compare", _compare, "run a pipeline and a step under several runners; table, HTML and JSON",
        "Run the pipeline named by TARGET and a training step under each runner, in\n"
        "interleaved rounds (each runner one short window per round); print batches/s\n"
        "with its spread, step time, data wait, CPU and GIL wait per runner, the ratios\n"
        "to cache (the headspace: loading made free) and warnings; write an HTML report\n"
        "and the comparison as JSON.",
        "spdl-lab compare mypkg.data:make_pipeline --step simulated:20 --runners thread cache"
        + _writes(f"compare-{_stem(EXAMPLE_TARGET)}"), runs=True)
    _target(cmp)
    _comparison_options(cmp, steps=100, num_workers=None)
    add_outputs(cmp, ("--report",), "compare-MODULE-ATTR.html",
             f"where the comparison's JSON goes (default: {REPORT_DIR_HELP}, compare-MODULE-ATTR.json)")

    diag = _subcommand(
        sub, "diagnose", _diagnose, "profile each stage of a pipeline alone, sweeping concurrency; write reports",
        "Run each stage of the pipeline named by TARGET alone, fed cached inputs, at each\n"
        "concurrency, and give a verdict per stage (scales, cpu-bound, gil-bound,\n"
        "contended) with the evidence; write an HTML and a JSON report.",
        "spdl-lab diagnose mypkg.data:make_pipeline --concurrency 1 2 4 8 --num-items 200"
        + _writes(_stem(EXAMPLE_TARGET)), runs=True)
    _target(diag, step=False)
    diag.add_argument("--concurrency", type=count(1, MAX_CONCURRENCY), nargs="+", default=[1, 2, 4, 8, 16],
                      metavar="N", help="thread counts to sweep (default: 1 2 4 8 16)")
    diag.add_argument("--num-items", type=count(1), default=100, metavar="N",
                      help="inputs collected from the source (default 100)")
    diag.add_argument("--no-processes", action="store_true",
                      help="skip the process-pool sweep of stages that do not scale with threads")
    diag.add_argument("--report-dir", default=None, metavar="DIR",
                      help=f"where reports go (default: {REPORT_DIR_HELP})")

    tune = _subcommand(
        sub, "tune", _tune, "search runner and concurrency for the most batches/s; table, code, HTML report",
        "Within a budget of wall time, move one knob at a time (a stage's threads, the workers,\n"
        "the runner) and keep a move only beyond the noise; then measure the best against the\n"
        "start side by side. Print the trials, the log and the code to paste; write an HTML report.",
        "spdl-lab tune mypkg.data:make_pipeline --step simulated:20 --budget 60 --runners thread,process"
        + _writes(f"tune-{_stem(EXAMPLE_TARGET)}", (".html",))
        + "\n  spdl-lab tune --set num_workers=4 --steps 200 --script train.py --epochs 3", runs=True)
    _target(tune, optional=" (not with --script)")
    tune.add_argument("--budget", type=seconds, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                      help=f"wall time for the whole tuning, the final side-by-side check included "
                           f"(default {DEFAULT_BUDGET_S:g})")
    tune.add_argument("--runners", type=_runner_names, nargs="+", default=None, metavar="RUNNER",
                      help=f"runners to choose between, by spaces or commas "
                           f"(default: {','.join(TUNABLE_RUNNERS)})")
    tune.add_argument("--start", choices=TUNABLE_RUNNERS, default=None, metavar="RUNNER",
                      help="the runner to start from, at the pipeline's own concurrency "
                           "(default: the first of --runners)")
    add_outputs(tune, ("-o", "--output"), "tune-MODULE-ATTR.html",
                "also save the tuning as JSON (lab.Tuning.from_json reads it)")
    job = tune.add_argument_group(
        "checking advice in the job itself (--script)",
        "Run the unchanged script under watch, alternately with its own DataLoader arguments and\n"
        "with the advice (given to every DataLoader it builds through $SPDL_LAB_DATALOADER_KWARGS),\n"
        "each run stopped after its steps; print the job's own steps/s both ways.")
    job.add_argument("--set", type=_setting, action="append", metavar="KEY=VALUE",
                     help="a DataLoader keyword argument to try, e.g. --set num_workers=4 (repeatable)")
    job.add_argument("--advice", metavar="TUNING.json",
                     help="take the DataLoader arguments of a saved tuning's best configuration")
    job.add_argument("--steps", type=count(1), default=200, metavar="N", help="steps counted per run (default 200)")
    job.add_argument("--warmup", type=count(0), default=20, metavar="N",
                     help="steps not counted at the start of each run (default 20)")
    job.add_argument("--rounds", type=count(2), default=2, metavar="N",
                     help="runs each way, alternating; at least 2 (default 2)")
    job.add_argument("--timeout", type=seconds, default=600.0, metavar="SECONDS",
                     help="longest one run may take (default 600)")
    job.add_argument("--script", nargs=argparse.REMAINDER, metavar="SCRIPT",
                     help="the script and its arguments, last on the line: --script train.py --epochs 3 "
                          "(a .py runs with this Python)")

    render = _subcommand(
        sub, "report", report, "render a saved diagnosis, comparison or run record as a self-contained HTML file",
        "Render a diagnosis or comparison saved as JSON (by spdl-lab diagnose,\n"
        "spdl-lab compare --json, Diagnosis.to_json or Comparison.to_json), or a run's\n"
        "record (.sqlite, by lab.publish or spdl-lab watch), or a torchrun job's record\n"
        "folder (a rankR.sqlite per rank), as one HTML file that opens without a network\n"
        "(Bokeh inline). The file is checked strictly and never executed.",
        f"spdl-lab report {EXAMPLE_REPORT} -o diagnosis.html\n  (reads the JSON spdl-lab diagnose "
        "wrote in the example above; writes diagnosis.html)\n  "
        "spdl-lab report spdl_lab_runs/resnet-4242.sqlite -o run.html\n  (a run spdl-lab watch recorded: "
        "its state, medians of the step, stages, CPU and GIL wait, plots over time)\n  "
        "spdl-lab report spdl_lab_runs/train-4cc7fda4 -o job.html\n  (a torchrun job: a row per rank, "
        "the straggler verdict, each rank's line over time)")
    watch = _subcommand(
        sub, "watch", lambda args: run_watched(args.script, name=args.name, record=args.record),
        "run a training script with its runs published for lab.attach",
        "Run COMMAND (a training script, unchanged) with SPDL_LAB_WATCH=1: every torch\n"
        "DataLoader, SPDL pipeline and lab.Loader it iterates and every lab.run session is\n"
        "published (a record file and a local endpoint) for lab.attach() in a notebook.\n"
        "Under torchrun every rank publishes, with its rank and the job's id; the job's\n"
        "records go into one folder. Exits with the script's status; SIGTERM and SIGHUP\n"
        "are passed on to it.",
        "spdl-lab watch --name resnet -- python train.py --epochs 3\n"
        "  (writes spdl_lab_runs/resnet-PID.sqlite; in a notebook: lab.attach(\"resnet\"))\n"
        "spdl-lab watch --name train -- torchrun --nproc_per_node=2 train.py\n"
        "  (every rank: spdl_lab_runs/train-JOBID/rankR.sqlite; lab.attach(\"train\") is the job)")
    watch.add_argument("--name", default=None, metavar="NAME",
                       help="the published runs' name (default: the script and line that started each)")
    watch.add_argument("--record", default=None, metavar="PATH.sqlite",
                       help="the record file (default: ./spdl_lab_runs/NAME-PID.sqlite)")
    watch.add_argument("script", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                       help="the command to run, after --")
    render.add_argument("file", metavar="FILE",
                        help="a saved diagnosis or comparison (.json), or a run's record (.sqlite or .db)")
    render.add_argument("-o", "--output", default=None, metavar="OUT.html",
                        help="where the HTML goes (default: FILE with .html in place of its suffix)")
    return parser


def _interrupted(prog: str, exiting: bool) -> int:
    """Ctrl-C: one line and 130. A ``main(argv)`` caller keeps its handler (children would inherit an
    ignored SIGINT); the command ignores a second Ctrl-C (a traceback mid-clean-up) and ends now: it
    kills what the clean-up left (a runner stopped while starting) and skips the interpreter's
    finalization, where Ray's interrupted threads can crash it (SIGSEGV)."""
    if exiting and threading.current_thread() is threading.main_thread():  # signal.signal works only there
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupt_taken()
    print(f"{prog}: interrupted", file=sys.stderr)
    if exiting:
        kill_all(psutil.Process().children(recursive=True))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker without stderr: workers stopped by Ctrl-C while
    starting leave it KeyError tracebacks to print, about segments the lab removes itself."""
    from multiprocessing import resource_tracker

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # the tracker inherits descriptor 2 as it is while it starts
    try:
        resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)  # argparse itself exits 2 on a bad option
    prog = f"spdl-lab {args.command}"
    try:
        if argv is None:  # the command itself: Ctrl-C from here raises, though never inside an import
            import_safe_interrupts()
            if args.runs_pipeline:
                _quiet_resource_tracker()
        return args.run(args)
    except (UsageError, PipelineSpecError, FileFormatError) as exc:
        print(f"{prog}: error: {one_line(exc, limit=None)}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, Exception) as exc:  # a stage or the step raised, a runner died
        if in_chain(exc, KeyboardInterrupt):  # Ctrl-C, or an error a library wrapped it in
            return _interrupted(prog, exiting=argv is None)
        traceback.print_exc()
        print(f"{prog}: failed: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if argv is None and threading.current_thread() is threading.main_thread():
            # Its work is done, or failed and said so: a Ctrl-C now would only kill the interpreter's
            # exit (status -2, no line), as Python restores the default handler there.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            interrupt_taken()


if __name__ == "__main__":
    sys.exit(main())
