"""``lab.diagnose``: each stage alone, swept over concurrency in threads and processes,
a verdict per stage and the stage that limits the pipeline.

Where things are:

* ``measure``   — ``diagnose()``: the source run once, each stage fed cached inputs,
  the sweep, the verdicts;
* ``settings``  — ``SweepSettings`` (windows, stop rule, budget) and the window and budget rules;
* ``_sweep``    — one point state machine (``_point``), the executor a parameter: ``_threads``
  or ``_processes`` (with ``_sweep_worker`` and ``_sweep_child``); ``_slices`` — a window's
  and a point's QPS;
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
