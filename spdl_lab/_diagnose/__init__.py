"""``lab.diagnose``: each stage alone, swept over concurrency in threads and processes, a verdict
per stage and the stage that limits the pipeline. ``measure`` runs it, ``result`` judges and holds
the ``Diagnosis``, ``env_mode`` is ``SPDL_PIPELINE_DIAGNOSTIC_MODE=1``."""

from ._sweep import SweepSettings as SweepSettings
from .measure import diagnose as diagnose
from .result import Diagnosis as Diagnosis
