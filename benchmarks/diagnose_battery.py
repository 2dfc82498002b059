"""Does ``lab.diagnose`` say the right thing about functions the tests never show it?

Twenty-one stage functions of known behaviour, three to a pipeline, each
pipeline diagnosed once with the default concurrency and settings. Printed per
function: the verdict expected on a 2-core machine, the verdict given and the
best concurrency, then the evidence; per pipeline, the wall time (target: <= 60 s for
three stages). The unit tests hold a smaller battery (``tests/diagnose``);
this one is for changes to the rules or the measurement, and takes about five
minutes. Run it on a quiet machine: the evidence says when other processes
held the cores.

    python benchmarks/diagnose_battery.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import json
import lzma
import re
import select
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402

import spdl_lab as lab  # noqa: E402

TARGET_WALL_S = 60.0

_BYTES = np.random.default_rng(1).integers(0, 255, 4_000_000, dtype=np.uint8).tobytes()
_TEXT = "the quick brown fox jumps over the lazy dog " * 2000
_RECORD = {f"k{i}": [i, str(i), {"a": i}] for i in range(3000)}
_FLOATS = np.random.default_rng(2).random(1_000_000)
_SMALL = np.arange(100, dtype=np.float64)
_LOCKS = [threading.Lock() for _ in range(3)]
_ONE_AT_A_TIME = threading.Semaphore(1)


# -- holds the GIL ---------------------------------------------------------------------

def small_loop(x):
    total = 0
    for i in range(3000):
        total += i
    return x


def json_round_trip(x):
    json.loads(json.dumps(_RECORD))
    return x


def regex(x):
    re.findall(r"\b\w+o\w*\b", _TEXT)
    return x


def sort_with_key(x):
    sorted(range(50_000), key=lambda v: -v)
    return x


def small_numpy(x):
    for _ in range(200):
        _SMALL.sum()  # each call is shorter than its Python overhead
    return x


def identity(x):
    return x


def sleep_then_python(x):
    time.sleep(0.002)  # overlaps across threads until the Python part fills the GIL
    total = 0
    for i in range(15_000):
        total += i
    return x


# -- waits without the GIL or a core ---------------------------------------------------

def sleep_10ms(x):
    time.sleep(0.01)
    return x


def select_3ms(x):
    select.select([], [], [], 0.003)
    return x


def event_wait_5ms(x):
    threading.Event().wait(0.005)
    return x


def sleep_100ms(x):
    time.sleep(0.1)
    return x


# -- releases the GIL, needs a core ----------------------------------------------------

def blake2b_4mb(x):
    hashlib.blake2b(_BYTES).digest()
    return x


def bz2_300kb(x):
    bz2.compress(_BYTES[:300_000])
    return x


def numpy_sort_1m(x):
    np.sort(_FLOATS)
    return x


def md5_4mb(x):
    hashlib.md5(_BYTES).digest()
    return x


def lzma_200kb(x):
    lzma.compress(_BYTES[:200_000], preset=1)
    return x


def zlib_1mb(x):
    zlib.compress(_BYTES[:1_000_000], 6)
    return x


# -- serialized by something shared ----------------------------------------------------

def lock_around_sleep(x):
    with _LOCKS[0]:
        time.sleep(0.003)
    return x


def lock_around_hash(x):
    with _LOCKS[1]:
        hashlib.sha256(_BYTES[:1_000_000]).digest()
    return x


def legacy_global_rng(x):
    np.random.random(400_000)  # numpy's legacy RandomState: one lock for every caller
    return x


def semaphore_of_one(x):
    with _ONE_AT_A_TIME:
        time.sleep(0.002)
    return x


PIPELINES = [
    [(small_loop, "gil-bound"), (json_round_trip, "gil-bound"), (regex, "gil-bound")],
    [(sort_with_key, "gil-bound"), (small_numpy, "gil-bound"), (identity, "gil-bound")],
    [(sleep_then_python, "gil-bound"), (sleep_10ms, "scales"), (select_3ms, "scales")],
    [(event_wait_5ms, "scales"), (sleep_100ms, "scales"), (blake2b_4mb, "cpu-bound")],
    [(bz2_300kb, "cpu-bound"), (numpy_sort_1m, "cpu-bound"), (md5_4mb, "cpu-bound")],
    [(lzma_200kb, "cpu-bound"), (zlib_1mb, "cpu-bound"), (lock_around_sleep, "contended")],
    [(lock_around_hash, "contended"), (legacy_global_rng, "contended"), (semaphore_of_one, "contended")],
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME",
                    help="diagnose only the pipelines holding these functions")
    args = ap.parse_args(argv)
    print(machine_line())
    print("# every pipeline: 3 map stages, lab.diagnose with its defaults\n")
    rows, walls, evidence = [], [], []
    for stages in PIPELINES:
        if args.only and not any(fn.__name__ in args.only for fn, _ in stages):
            continue
        p = lab.Pipeline(range(1000))
        for fn, _ in stages:
            p = p.map(fn, name=fn.__name__)
        t0 = time.perf_counter()
        diag = lab.diagnose(p, progress=False)
        walls.append(time.perf_counter() - t0)
        names = ", ".join(fn.__name__ for fn, _ in stages)
        print(f"{names}: {walls[-1]:.1f} s", flush=True)
        for fn, want in stages:
            got = diag.stages[fn.__name__]
            rows.append([fn.__name__, want, got.verdict or "-", got.best_concurrency or "-",
                         "yes" if got.verdict == want else "NO"])
            evidence.append(f"- {fn.__name__}: {got.evidence}")
    print()
    print_table(["function", "expected", "verdict", "best c", "right"], rows)
    print("\n" + "\n".join(evidence))
    right = sum(r[4] == "yes" for r in rows)
    over = [w for w in walls if w > TARGET_WALL_S]
    print(f"\n{right} of {len(rows)} verdicts as expected")
    print(f"{'PASS' if not over else 'MISS'}  wall time per 3-stage diagnose <= {TARGET_WALL_S:.0f} s: "
          + ", ".join(f"{w:.1f} s" for w in walls))
    return 0 if right == len(rows) and not over else 1


if __name__ == "__main__":
    sys.exit(main())
