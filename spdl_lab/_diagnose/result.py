"""What ``lab.diagnose`` returns (per stage: its points, a verdict, what to change) and the rules
from a stage's thread points to its verdict (``judge``). The dataclasses describe the JSON file too
(checked by pydantic; never pickled); plots and HTML come from ``_ui`` through ``_views``."""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import pandas as pd
from pydantic import PlainValidator

from .. import _file_checks
from .._experiments.comparison import BUSY_MACHINE
from .._file_checks import RECORD, Count, Meta, Name, Rate, Share, Text, integer, refuse
from .._pipeline import MAX_CONCURRENCY
from .._table import amount, num, text_table
from .._views import view
from ..errors import FileFormatError

#: ``scales``: QPS rises, neither the GIL nor the cores are full; ``cpu-bound``: the cores are busy;
#: ``gil-bound``: the GIL probe waits, or caps a rise; ``contended``: neither, a lock serializes it.
VERDICTS = ("scales", "cpu-bound", "gil-bound", "contended")

TABLE_COLUMNS = [  # of ``Diagnosis.table``, in order
    "stage", "executor", "concurrency", "qps", "cpu_util", "gil_wait_frac",
    "runqueue_wait_frac", "p50_ms", "repeats", "qps_spread", "status", "machine_cpu_util",
]

FAR_FASTER = 2.0  # a stage this many times faster than the limiting one gets a verdict, no advice
RISE_MIN_SPEEDUP = 1.5  # a stage "rises": its best thread QPS is this many times its first point's
#: A stage that kept a core this busy at its lowest concurrency rises only by using more CPU:
#: with CPU growing less than CPU_GROWTH, the rise is the machine's speed changing.
BUSY_CORE = 0.8
CPU_GROWTH = 1.3
CPU_SATURATED = 0.75  # share of all cores busy at the best point: the cores are the limit
GIL_WAIT_BOUND = 0.30  # GIL probe wait share (concurrency >= 2): the GIL is what workers wait for
BEST_WITHIN = 0.05  # best_concurrency: the least within this share of the best QPS...
BEST_NOISE_CAP = 0.15  # ...or within the best point's window spread, up to this
PROCESS_HELPS = 1.3  # process QPS over the best thread QPS at which processes are advised

MAX_STAGES, MAX_POINTS = 1000, 10_000  # in a file; points over all its stages
Concurrency = integer(1, MAX_CONCURRENCY)


class DiagnosisFormatError(FileFormatError):
    """A diagnosis file (or a Diagnosis being written) does not fit the format; ``field`` is its JSON path."""


@dataclass(frozen=True)
class Point:
    """One measured setting: a stage run alone at one concurrency by one executor."""

    __pydantic_config__ = RECORD

    stage: Name
    executor: Literal["thread", "process"]
    concurrency: Concurrency
    qps: Rate  # items/s: the second-best window (_sweep.point_qps); NaN: none finished
    qps_spread: Rate  # (max - min) / qps over the windows; NaN with < 2 windows
    cpu_util: Share  # CPU of this process and its children / (wall time x cores): 0..1
    gil_wait_frac: Share  # the GIL probe during the windows (NaN for processes)
    runqueue_wait_frac: Share  # the probe's run-queue wait (NaN for processes)
    p50_ms: Rate  # task time p50 over the windows
    repeats: integer(0, 10**6)  # measurement windows
    status: Literal["ok", "unstable", "timeout", "error"] = "ok"  # unstable: the cap came before stability
    failures: Count = 0  # tasks that raised during the point
    machine_cpu_util: Share = math.nan  # the whole machine's busy share (every process), 0..1


@dataclass(frozen=True)
class StageDiagnosis:
    __pydantic_config__ = RECORD

    name: Name
    kind: Literal["map", "batch"]
    verdict: Literal[VERDICTS] | None  # None for batch stages and stages not measured
    best_concurrency: Concurrency | None  # smallest concurrency within 5% (or the noise) of the best thread QPS
    evidence: Text  # one sentence with the numbers behind the verdict
    recommendation: Text  # what to change: runner, concurrency, or the function
    inputs: Count = 0  # cached inputs the stage was fed
    outputs: Count = 0  # outputs it produced (fewer when items failed or a batch dropped its tail)
    error: Text | None = None  # the traceback of a raising stage, or why it was not measured
    #: "unstable": measure again; "failed": an input raised, no verdict
    status: Literal["measured", "unstable", "failed", "not measured", "batch"] = "measured"
    notes: tuple[Text, ...] = ()  # the details behind the one-sentence evidence
    concurrency: Concurrency | None = None  # the stage's concurrency in the pipeline
    items_per_input: integer(1, 10**15) = 1  # source items per input of this stage (a batch's size after it)
    points: tuple[Point, ...] = ()  # last, in a file too: after the short fields a reader looks for

    def shown_status(self) -> str:
        """What a table shows in place of a verdict: "failed", "not measured" or "-"."""
        if self.status in ("failed", "not measured", "unstable"):
            return self.status
        return "failed" if self.error and self.kind == "map" else "-"

    def rate_now(self) -> float:
        """Source items/s at its pipeline concurrency (NaN: unknown): the thread point there, else
        linear in log2(concurrency) between the nearest two (levels double), else the nearest."""
        points = usable(self.thread_points())
        if not points or self.concurrency is None:
            return math.nan
        at = [math.log2(p.concurrency) for p in points]
        qps = np.interp(math.log2(self.concurrency), at, [p.qps for p in points])
        return float(qps) * self.items_per_input

    def peak_qps(self, executor: str = "thread") -> float:
        """The highest QPS ``executor`` reached (NaN: none measured)."""
        return max((p.qps for p in self.points if p.executor == executor and math.isfinite(p.qps)), default=math.nan)

    def thread_points(self) -> list[Point]:
        return [p for p in self.points if p.executor == "thread"]


def _stages(value: Any) -> dict[str, StageDiagnosis]:
    """A file's list of stages, each named once, as ``Diagnosis.stages``."""
    if isinstance(value, list) and len(value) > MAX_STAGES:
        refuse((), f"{len(value)} stages, more than the limit of {MAX_STAGES}")
    stages: dict[str, StageDiagnosis] = {}
    points = 0
    for i, stage in enumerate(_file_checks.check(list[StageDiagnosis], value)):
        if stage.name in stages:
            refuse((i, "name"), f"stage {stage.name[:60]!r} appears twice")
        stages[stage.name] = stage
        wrong = next((j for j, p in enumerate(stage.points) if p.stage != stage.name), None)
        if wrong is not None:
            refuse((i, "points", wrong, "stage"), f"Input should be {stage.name[:60]!r} (the enclosing stage)")
        points += len(stage.points)
        if points > MAX_POINTS:
            refuse((i, "points"), f"more than the limit of {MAX_POINTS} points in all")
    return stages


@dataclass
class Diagnosis(_file_checks.Saved):
    """``lab.diagnose``'s result. ``stages[name].verdict``, ``.table``, ``.plot()``,
    ``to_html(path)``, ``to_json(path)``, ``Diagnosis.from_json(path)``."""

    __pydantic_config__ = RECORD
    VERSIONS: ClassVar = (1, 2)
    ERROR: ClassVar = DiagnosisFormatError
    FIX: ClassVar = ("Only files written by Diagnosis.to_json can be read; run lab.diagnose again and save it "
                     "with .to_json(path)")

    pipeline: Text  # the pipeline's repr
    stages: Annotated[dict[str, StageDiagnosis], PlainValidator(_stages)]  # a list in the file
    settings: Meta = field(default_factory=dict)  # concurrency, num_items, windows...
    machine: Meta = field(default_factory=dict)  # cores, python, gil
    created: Name = ""  # ISO 8601 time the diagnosis started
    elapsed_s: Rate = math.nan

    @property
    def table(self) -> pd.DataFrame:
        """One row per measured point (TABLE_COLUMNS)."""
        rows = [{c: getattr(p, c) for c in TABLE_COLUMNS} for s in self.stages.values() for p in s.points]
        return pd.DataFrame(rows, columns=TABLE_COLUMNS)

    @property
    def bottleneck(self) -> str | None:
        """The stage that limits the pipeline at its current concurrency (None: none measured)."""
        found = limiting(self.stages.values())
        return found[0].name if found else None

    def in_order(self) -> list[StageDiagnosis]:
        """The stages, the limiting one first."""
        limit = self.bottleneck
        return sorted(self.stages.values(), key=lambda s: s.name != limit)

    def headline(self) -> str:
        """One sentence: which stage limits the pipeline, by how much, and what to change."""
        failed = ", ".join(repr(s.name) for s in self.stages.values() if s.status == "failed")
        parts = [f"Stage {failed} failed: fix it first (its traceback is below)."] if failed else []
        if (found := limiting(self.stages.values())) is None:
            return " ".join(parts) or "No stage could be measured, so no stage can be named as the limit."
        s, rate, nxt, nxt_rate = found
        by = (f", {nxt_rate / rate:.1f}x slower than the next slowest ({nxt.name!r}, {amount(nxt_rate)} items/s)"
              if nxt is not None else ", the only measured stage")
        advice = (f" Its numbers are not settled: {s.recommendation}." if s.status == "unstable"
                  else f" To go faster: {s.recommendation}." if s.recommendation else "")
        parts.append(f"{s.name!r} limits the pipeline: {amount(rate)} items/s at its concurrency {s.concurrency} "
                     f"({s.verdict or s.status}){by}.{advice}")
        return " ".join(parts)

    def machine_load(self) -> str:
        """Other processes' load while the stages were measured, and the sessions paused ("" if neither)."""
        others = [p.machine_cpu_util - p.cpu_util for s in self.stages.values() for p in s.thread_points()
                  if not math.isnan(p.machine_cpu_util) and not math.isnan(p.cpu_util)]
        worst = max(others, default=0.0)
        paused = self.settings.get("paused_sessions") or 0
        said = []
        if paused:
            said.append(f"{paused} running session{'s' if paused > 1 else ''} of this kernel "
                        f"{'were' if paused > 1 else 'was'} paused while the stages were measured.")
        if worst >= BUSY_MACHINE:
            said.append(f"Other processes used up to {worst:.0%} of the {self.machine.get('cpu_cores', '?')} cores "
                        "while stages were measured: rates may be low; diagnose again on a quiet machine.")
        return " ".join(said)

    def verdicts(self) -> pd.DataFrame:
        """One row per stage, the limiting stage first: verdict, best concurrency, evidence, advice."""
        rows = [{"stage": s.name, "verdict": s.verdict or s.status, "best_concurrency": s.best_concurrency,
                 "evidence": s.evidence, "recommendation": s.recommendation} for s in self.in_order()]
        frame = pd.DataFrame(rows).set_index("stage")
        frame["best_concurrency"] = frame["best_concurrency"].astype("Int64")  # None stays <NA>, ints stay ints
        return frame

    def summary(self, width: int = 100) -> str:
        """A plain-text table for terminals, a block per stage. Every string passes through
        ``_printable``: a file someone sent must not drive the terminal it is printed on."""
        elapsed = f", {self.elapsed_s:.1f} s" if math.isfinite(self.elapsed_s) else ""
        created = f", {_printable(self.created)}" if self.created else ""
        pipeline = _printable(self.pipeline.splitlines()[0]) if self.pipeline else ""
        lines = [textwrap.shorten(f"diagnosis of {pipeline}", width, placeholder="..."),
                 f"{len(self.stages)} stages{elapsed}{created}", ""]
        for sentence in (self.headline(), self.machine_load()):
            lines += textwrap.wrap(_printable(sentence), width)
        order = self.in_order()
        rows = [[_printable(s.name) if len(_printable(s.name)) <= 30 else _printable(s.name)[:27] + "...",
                 _printable(s.kind), _printable(s.verdict or s.shown_status()),
                 "-" if s.best_concurrency is None else str(s.best_concurrency),
                 num(s.peak_qps(), ",.1f"), num(s.peak_qps("process"), ",.1f")] for s in order]
        table = text_table(["stage", "kind", "verdict", "best", "thread qps", "process qps"], rows, left=(0, 1, 2))
        lines += ["", table[0], "-" * len(table[0])]
        for s, row in zip(order, table[1:]):
            lines.append(row)
            for label, text in (("evidence", s.evidence), ("do", s.recommendation), ("error", _last_line(s.error))):
                if text:
                    lines += textwrap.wrap(_printable(" ".join(text.split())), width, initial_indent=f"    {label}: ",
                                           subsequent_indent="      ", max_lines=4, placeholder=" ...")
        return "\n".join(lines)

    def plot(self) -> Any:
        """Bokeh: QPS against concurrency per stage, with CPU and GIL wait."""
        return view("diagnosis_plot")(self)

    def to_html(self, path: str | Path) -> Path:
        """One self-contained HTML file (INLINE Bokeh, no network)."""
        return view("diagnosis_report")(self, path)

    def _repr_html_(self) -> str:
        return view("diagnosis_html")(self)

    def _saved_fields(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["stages"] = list(doc["stages"].values())
        return doc

    def _checked(self, version: int) -> Diagnosis:
        """Version 1 files have no stage status: it follows from the other fields."""
        if version == 1:
            self.stages = {n: replace(s, status=_v1_status(s)) for n, s in self.stages.items()}
        return self

    def __repr__(self) -> str:
        return self.summary()


def usable(points: Iterable[Point]) -> list[Point]:
    """The points that finished with a rate, by concurrency."""
    return sorted((p for p in points if p.status in ("ok", "unstable") and p.qps > 0), key=lambda p: p.concurrency)


def limiting(stages: Iterable[StageDiagnosis]) -> tuple[StageDiagnosis, float, StageDiagnosis | None, float] | None:
    """(slowest stage, its rate, next slowest, its rate) among stages measured, each stage
    compared at its concurrency in the pipeline and in source items/s (``rate_now``)."""
    rated = sorted(((s, s.rate_now()) for s in stages if s.verdict is not None or s.status == "unstable"),
                   key=lambda sr: sr[1])
    if not (rated := [(s, r) for s, r in rated if not math.isnan(r)]):
        return None
    nxt, nxt_rate = rated[1] if len(rated) > 1 else (None, math.nan)
    return rated[0][0], rated[0][1], nxt, nxt_rate


def _printable(text: str) -> str:
    """``text`` with control and format characters (ESC, BEL, CSI, bidi overrides) written as escapes."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _last_line(error: str | None) -> str:
    """A traceback's last line is the exception and its message: enough for a terminal."""
    lines = [ln for ln in (error or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def _v1_status(stage: StageDiagnosis) -> str:
    if stage.kind == "batch":
        return "batch"
    if stage.verdict is not None:
        return "measured"
    return "not measured" if stage.evidence.startswith("not measured") else "failed"


@dataclass(frozen=True)
class Judgement:
    verdict: str | None
    best_concurrency: int | None
    evidence: str  # one short sentence that agrees with the verdict
    recommendation: str
    details: str = ""  # the numbers behind it, for the report's details and the JSON


def rises(thread_points: Sequence[Point], cores: int) -> bool:
    """Whether thread QPS grows with concurrency (also decides whether processes are tried)."""
    ok = usable(thread_points)
    if len(ok) < 2:
        return False
    first, best = ok[0], max(ok, key=lambda p: p.qps)
    if best.qps < RISE_MIN_SPEEDUP * first.qps:
        return False
    busy_at_first = first.cpu_util * cores >= BUSY_CORE * min(first.concurrency, cores)
    return not busy_at_first or best.cpu_util >= CPU_GROWTH * first.cpu_util


def judge(thread_points: Sequence[Point], process_points: Sequence[Point] = (), *, cores: int) -> Judgement:
    if not (ok := usable(thread_points)):
        return Judgement(None, None, "no measurement finished, so there is nothing to judge", "")
    first, best = ok[0], max(ok, key=lambda p: p.qps)
    tolerance = max(BEST_WITHIN, min(BEST_NOISE_CAP, 0.0 if math.isnan(best.qps_spread) else best.qps_spread))
    best_c = min(p.concurrency for p in ok if p.qps >= (1 - tolerance) * best.qps)
    speedup, cpu, machine = best.qps / first.qps, best.cpu_util, best.machine_cpu_util
    crowded = not cpu >= CPU_SATURATED and machine >= CPU_SATURATED  # others hold the cores
    gils = [p.gil_wait_frac for p in ok if p.concurrency >= 2 and not math.isnan(p.gil_wait_frac)]
    gil = statistics.median(gils) if gils else math.nan
    lo, hi = first.concurrency, ok[-1].concurrency
    span = f"from {lo} to {hi} threads"
    cpu_text = f"CPU at {_pct(cpu)} of {cores} cores"

    rising = rises(ok, cores)
    # Part I/O, part Python: it rises while the waits overlap, then the Python parts
    # queue for the GIL. The median over all points is low; the top point tells.
    ceiling = (rising and best_c < hi and not cpu >= CPU_SATURATED
               and ok[-1].gil_wait_frac >= GIL_WAIT_BOUND)
    gil_bound = gil >= GIL_WAIT_BOUND or ceiling
    if rising and not gil_bound and not cpu >= CPU_SATURATED:
        verdict = "scales"
        details = (f"QPS rose {speedup:.1f}x {span} ({amount(first.qps)} to {amount(best.qps)}/s, best at "
                   f"{best_c}) with {cpu_text}: the workers wait without holding the GIL or a core.")
        evidence = (f"QPS rose {speedup:.1f}x from {lo} to {best_c} threads without filling the cores "
                    f"or waiting on the GIL.")
        advice = f"set concurrency to {best_c}"
        if best_c == hi:
            advice += f" or more: QPS was still rising at {hi}"
    elif (cpu >= CPU_SATURATED or crowded) and not gil_bound:
        verdict = "cpu-bound"
        details = (f"QPS {'rose' if rising else 'changed'} {speedup:.1f}x {span} to "
                   f"{amount(best.qps)}/s at {best_c}")
        evidence = f"The cores were {_pct(cpu)} busy at {best_c} threads ({amount(best.qps)}/s): they are the limit."
        advice = (f"concurrency {best_c} is enough; more threads add nothing once the cores are busy. "
                  f"To go faster, make the function cheaper or give it more cores")
        if crowded:
            details += (f"; this process used {_pct(cpu)} of {cores} cores but the machine was {_pct(machine)} "
                        f"busy: other processes held the cores it needed.")
            evidence = (f"The machine's cores were {_pct(machine)} busy, mostly with other processes: "
                        "they are the limit.")
            advice = "diagnose again on a quiet machine: other processes held the cores; " + advice
        else:
            details += f", with {cpu_text} there: the cores are the limit."
    elif gil_bound:
        verdict = "gil-bound"
        advice = ("keep it off the training process's GIL: run the pipeline under subprocess-threads, "
                  "or make the function release the GIL (numpy/torch operations on whole arrays)")
        if ceiling and not gil >= GIL_WAIT_BOUND:
            details = (f"QPS rose {speedup:.1f}x from {lo} to {best_c} threads ({amount(first.qps)} to "
                       f"{amount(best.qps)}/s) and no further, with {cpu_text}; at {hi} threads the GIL probe "
                       f"waited {_pct(ok[-1].gil_wait_frac)} of the time: its waits overlap, its Python "
                       f"parts queue for the GIL.")
            evidence = (f"QPS stopped rising at {best_c} threads while the GIL probe waited "
                        f"{_pct(ok[-1].gil_wait_frac)} at {hi}: the GIL is its ceiling.")
            advice = f"set concurrency to {best_c}; to go faster, " + advice
        else:
            details = (f"QPS changed {speedup:.1f}x {span} (best {amount(best.qps)}/s at {best_c}) while the GIL "
                       f"probe waited {_pct(gil)} of the time, with {cpu_text}: the function holds the GIL.")
            evidence = (f"The GIL probe waited {_pct(gil)} of the time with 2 or more threads: "
                        f"the function holds the GIL.")
    else:
        verdict = "contended"
        gil_text = "GIL wait n/a" if math.isnan(gil) else f"GIL wait {_pct(gil)}"
        details = (f"QPS changed {speedup:.1f}x {span} (best {amount(best.qps)}/s at {best_c}) with "
                   f"{cpu_text} and {gil_text}: neither the GIL nor the cores are full, so a lock "
                   f"or another shared resource serializes it.")
        evidence = (f"More threads did not help, yet neither the GIL ({gil_text.removeprefix('GIL wait ')}) "
                    f"nor the cores ({_pct(cpu)}) were full: something shared serializes it.")
        advice = (f"concurrency {best_c} is as fast as any; find the shared lock or resource (a global "
                  f"RNG such as np.random.*: give each worker np.random.default_rng(); a shared "
                  f"client or lock) and give each worker its own")
    # A process point runs one task per worker: it cannot overlap waits as threads do,
    # so falling short of many threads says nothing against processes of threads.
    details, advice = _with_processes(details, advice, verdict, best, process_points,
                                      comparable=not (ceiling and verdict == "gil-bound"))
    return Judgement(verdict, best_c, evidence, advice, details)


def _with_processes(details: str, advice: str, verdict: str, best: Point,
                    process_points: Sequence[Point], comparable: bool = True) -> tuple[str, str]:
    if not (ok := usable(process_points)):
        return details, advice
    top = max(ok, key=lambda p: p.qps)
    ratio = top.qps / best.qps
    details += (f" {top.concurrency} worker process{'es' if top.concurrency > 1 else ''} "
                 f"reached {amount(top.qps)}/s ({ratio:.1f}x the best with threads).")
    if ratio >= PROCESS_HELPS:
        advice = (f"processes help: {ratio:.1f}x with {top.concurrency} processes; run this stage under "
                  f"the process runner (DataLoader workers) or subprocess-threads; or " + advice)
    elif verdict in ("gil-bound", "contended") and comparable:
        advice += "; processes did not help here either"
    return details, advice


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"
