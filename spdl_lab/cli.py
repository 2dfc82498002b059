"""The ``spdl-lab`` command (also ``python -m spdl_lab``).

Exit codes: 0 ok, 1 diagnostic-mode exit, 2 usage error.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import sysconfig
import time

__all__ = ["main"]


def _info(_: argparse.Namespace) -> int:
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    free_threaded = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    print(f"python      {platform.python_version()} ({sys.executable})")
    print(f"build       {'free-threaded' if free_threaded else 'with GIL'}; GIL {'on' if gil else 'off'}")
    print(f"cpu cores   {os.cpu_count()}")
    try:
        import torch

        cuda = torch.cuda.is_available()
        print(f"torch       {torch.__version__}; CUDA {'available' if cuda else 'not available'}")
    except ImportError:
        print("torch       not installed")
    import spdl_lab

    print(f"spdl_lab    {spdl_lab.__version__}; runners: {', '.join(spdl_lab.RUNNERS)}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import spdl_lab as lab

    def fetch(i: int) -> int:
        time.sleep(0.002)
        return i

    def decode(i: int) -> list[int]:
        return [i * k for k in range(256)]

    p = (
        lab.Pipeline(range(args.items))
        .map(fetch, concurrency=8, name="fetch")
        .map(decode, concurrency=2, name="decode")
        .batch(32)
        .map(len, name="collate")
    )
    print(p, "\n")
    with lab.Loader(p, runner=args.runner) as loader:
        t0 = time.perf_counter()
        batches = sum(1 for _ in loader)
        elapsed = time.perf_counter() - t0
        print(loader.stats())
    print(f"\n{batches} batches in {elapsed:.2f} s ({batches / elapsed:.1f} batches/s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spdl-lab", description="spdl_lab: a lab bench for data loading")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="interpreter, GIL, cores, torch and CUDA").set_defaults(run=_info)
    demo = sub.add_parser("demo", help="run a small pipeline and print its meters")
    demo.add_argument("--items", type=int, default=4000)
    demo.add_argument("--runner", default="thread")
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
