"""spdl_lab: a lab bench for data loading in PyTorch training. Bring a pipeline and a training
step; run them under several parallelism models, watch them live, find out where the time goes."""

from ._startup import quit_on_interrupt as _quit_on_interrupt

_quit_on_interrupt()  # only in the spdl-lab command's own process: Ctrl-C while it starts exits 130 quietly

from . import _views, workloads
from ._diagnose import Diagnosis, SweepSettings, diagnose
from ._diagnose.env_mode import start_hook as _diagnostic_mode
from ._experiments.compare import Comparison, compare, headspace
from ._experiments.session import Session, run
from ._integrations import from_dataloader, from_spdl
from ._loader import Loader
from ._pipeline import Pipeline, Stage
from ._runners import LOCAL_RUNNERS, RUNNERS
from ._runs import add_start_hook as _add_start_hook
from ._telemetry.snapshot import QueueStats, Snapshot, StageStats
from ._training import SimulatedDevice, StepClock
from ._tune import Tuning, tune
from ._watch.attach import RemoteSession
from ._watch.job import JobSession, attach
from ._watch.job import open_record as open  # noqa: A001 (lab.open(record_path))
from ._watch.publish import publish, unpublish
from ._watch.publish import start_hook as _watch_mode
from .errors import FileFormatError, PipelineError, PipelineSpecError, RunnerError, SpdlLabError

__version__ = "0.1.0"

# Before each run: SPDL_PIPELINE_DIAGNOSTIC_MODE=1 diagnoses, SPDL_LAB_WATCH=1 publishes.
_add_start_hook("diagnostic_mode", _diagnostic_mode)
_add_start_hook("watch", _watch_mode)

# What draws or drives a result, imported on first use: ``import spdl_lab`` loads no Bokeh.
_views.register(
    comparison_plot="spdl_lab._ui.report:comparison_plot",
    dashboard="spdl_lab._ui.dashboard:Dashboard",
    diagnosis_html="spdl_lab._ui.report:diagnosis_html",
    diagnosis_plot="spdl_lab._ui.report:diagnosis_plot",
    diagnosis_report="spdl_lab._ui.report:write_diagnosis_report",
    job_dashboard="spdl_lab._ui.job_dashboard:JobDashboard",
    job_report="spdl_lab._ui.job_dashboard:write_job_report",
    run_report="spdl_lab._ui.run_report:write_run_report",
    session_autotuner="spdl_lab._tune.tuner:AutoTuner",
    tuning_html="spdl_lab._ui.report:html_summary",
    tuning_plot="spdl_lab._ui.report:tuning_plot",
    tuning_report="spdl_lab._ui.report:write_html",
)

# The entry points and the types a user holds, sorted (a test keeps them so). ``lab.Dashboard``
# is reachable too but not listed: ``from spdl_lab import *`` must not load Bokeh.
__all__ = [
    "Comparison", "Diagnosis", "FileFormatError", "JobSession", "LOCAL_RUNNERS", "Loader",
    "Pipeline", "PipelineError", "PipelineSpecError", "QueueStats", "RUNNERS", "RemoteSession",
    "RunnerError", "Session", "SimulatedDevice", "Snapshot", "SpdlLabError", "Stage", "StageStats",
    "StepClock", "SweepSettings", "Tuning", "attach", "compare", "diagnose", "from_dataloader",
    "from_spdl", "headspace", "open", "publish", "run", "tune", "unpublish", "workloads"
]


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext spdl_lab``: add the %spdl_* magics (``import spdl_lab`` needs no IPython)."""
    from ._magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: object) -> None:
    """``%unload_ext spdl_lab``: remove the magics again."""
    from ._magics import unload_ipython_extension as unload

    unload(ipython)


def __getattr__(name: str) -> object:
    if name == "Dashboard":  # ipywidgets and Bokeh, imported on first use
        return _views.view("dashboard")
    raise AttributeError(f"module 'spdl_lab' has no attribute {name!r}")
