"""The ``spdl-lab`` command (also ``python -m spdl_lab``).

Exit codes: 0 ok, 1 diagnostic-mode exit, 2 usage error.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def _info(_: argparse.Namespace) -> int:
    import spdl_lab
    from spdl_lab.interpreter import describe

    for line in describe().lines():
        print(line)
    print(f"spdl_lab    {spdl_lab.__version__}; runners: {', '.join(spdl_lab.RUNNERS)}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """The parallelism study: compare every runner on the noisy-neighbour workload."""
    import spdl_lab as lab
    from spdl_lab.ui.report import write_comparison_report

    pipeline, device = lab.workloads.noisy_neighbour()
    print(f"noisy neighbour: {pipeline!r}\nstep: {device!r}\n")
    t0 = time.perf_counter()
    cmp = lab.compare(
        pipeline, step=device, steps=args.steps, warmup=args.warmup,
        runner_options={"process": {"num_workers": args.num_workers}},
    )
    print(cmp)
    print("\nbatches/s relative to cache (headspace):")
    for runner, ratio in cmp.ratios("cache").items():
        print(f"  {runner:<20} {ratio:.2f}x")
    path = write_comparison_report(cmp, args.report, title="spdl_lab demo: the noisy neighbour")
    print(f"\nreport: {path.resolve()}  ({time.perf_counter() - t0:.0f} s)")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    """Diagnose the Pipeline named by module:attr; write the HTML and JSON reports."""
    from spdl_lab.errors import PipelineSpecError
    from spdl_lab.experiments.diagnose import diagnose
    from spdl_lab.experiments.diagnostic_mode import write_reports

    try:
        pipeline = _load_pipeline(args.target)
        diagnosis = diagnose(pipeline, concurrency=args.concurrency, num_items=args.num_items,
                             processes=not args.no_processes)
    except PipelineSpecError as exc:
        print(f"spdl-lab diagnose: {exc}", file=sys.stderr)
        return 2
    html, data = write_reports(diagnosis, args.report_dir, stem=args.target.replace(":", "-"))
    print(diagnosis.summary())
    print(f"\nreport: {html.resolve()}\ndata:   {data.resolve()}")
    return 0


def _load_pipeline(target: str):
    """``module:attr`` (attr a lab.Pipeline or a zero-argument factory returning one)."""
    import importlib
    import os

    from spdl_lab.errors import PipelineSpecError
    from spdl_lab.pipeline import Pipeline

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PipelineSpecError(f"expected module:attr (e.g. mypkg.data:pipeline), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: modules next to you are found
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PipelineSpecError(f"cannot import {module_name!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PipelineSpecError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, Pipeline) and callable(obj):
        obj = obj()
    if not isinstance(obj, Pipeline):
        raise PipelineSpecError(
            f"{target} is a {type(obj).__name__}; expected a lab.Pipeline or a zero-argument function returning one"
        )
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spdl-lab", description="spdl_lab: a lab bench for data loading")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="interpreter, GIL, cores, torch and CUDA").set_defaults(run=_info)
    demo = sub.add_parser(
        "demo", help="compare every runner on the noisy-neighbour workload; write an HTML report"
    )
    demo.add_argument("--steps", type=int, default=120, help="measured steps per runner")
    demo.add_argument("--warmup", type=int, default=15, help="warm-up steps per runner")
    demo.add_argument("--num-workers", type=int, default=2, help="DataLoader workers for 'process'")
    demo.add_argument("--report", default="spdl_lab_reports/demo.html", help="where to write the report")
    demo.set_defaults(run=_demo)
    diag = sub.add_parser(
        "diagnose", help="profile each stage of a pipeline alone, sweeping concurrency; write reports",
        description="Profile each stage alone at each concurrency and give a verdict per stage "
                    "(scales, cpu-bound, gil-bound, contended). Exit 0 when done, 2 on a usage error.",
    )
    diag.add_argument("target", help="module:attr naming a lab.Pipeline or a zero-argument factory")
    diag.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                      help="thread counts to sweep (default: 1 2 4 8 16)")
    diag.add_argument("--num-items", type=int, default=100, help="inputs collected from the source")
    diag.add_argument("--no-processes", action="store_true",
                      help="skip the process-pool sweep of stages that do not scale with threads")
    diag.add_argument("--report-dir", default=None,
                      help="where reports go (default: $SPDL_LAB_REPORT_DIR or ./spdl_lab_reports)")
    diag.set_defaults(run=_diagnose)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
