"""``lab.diagnose``: each stage alone, swept over concurrency in threads and processes,
a verdict per stage and the stage that limits the pipeline.

Where things are:

* ``measure``   — ``diagnose()``: the source run once, each stage fed cached inputs,
  the thread and process sweeps, the verdicts;
* ``settings``  — ``SweepSettings`` (windows, stop rule, budget) and the window and budget rules;
* ``_thread_sweep`` / ``_process_sweep`` (with ``_sweep_worker`` and ``_sweep_child``) —
  the two halves of the sweep; ``_point`` — the stop rule and progress count they share;
  ``_slices`` — a window's and a point's QPS;
* ``rules``     — from a stage's points to a verdict, with the numbers;
* ``result``    — ``Diagnosis``, ``StageDiagnosis``, ``Point``, which stage limits, the JSON file;
* ``_isolated`` — the clean child interpreter it runs in;
  ``_pausing`` — the kernel's sessions paused meanwhile;
* ``env_mode``  — ``SPDL_PIPELINE_DIAGNOSTIC_MODE=1``: diagnose instead of training, no code change.
"""

from .measure import DEFAULT_CONCURRENCY, DEFAULT_NUM_ITEMS, diagnose
from .result import Diagnosis, Point, StageDiagnosis
from .settings import SweepSettings

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_NUM_ITEMS", "Diagnosis", "Point", "StageDiagnosis", "SweepSettings",
           "diagnose"]
