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
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
