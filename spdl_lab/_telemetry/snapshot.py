"""``Snapshot``: the figures of a run at one instant, as plain records."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any

import pandas as pd

from .._table import amount
from .meters import QueueReading, StageReading

_cell = partial(amount, small=".3g")


@dataclass(frozen=True)
class StageStats:
    """One stage's figures: ``qps`` over about the last second while live, else (and ``qps_avg``
    always) over the whole run; task times exclude waits; the queue is the stage's *input* (full:
    this stage is the slower side; a batch stage's: the partial batch)."""

    name: str
    kind: str
    tasks: int
    failures: int
    qps: float
    qps_avg: float
    mean_ms: float
    p50_ms: float
    p99_ms: float
    concurrency: int
    in_flight: int
    busy_frac: float
    queue_depth: int
    queue_capacity: int
    #: tasks per node, for a runner that spans nodes (``ray``): ``"ip/node-id-prefix" -> tasks``
    nodes: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, r: StageReading, elapsed_s: float, qps: float | None = None,
           queue: QueueReading | None = None) -> StageStats:
        """A stage's totals over ``elapsed_s``; ``qps`` the recent rate, if known, else the average."""
        avg = r.tasks / elapsed_s if elapsed_s > 0 else 0.0
        busy = r.busy_ns / 1e9 / elapsed_s / max(1, r.concurrency) if elapsed_s > 0 else 0.0
        return cls(r.name, r.kind, r.tasks, r.failures, avg if qps is None else qps, avg, r.mean_ms,
                   r.quantile_ms(0.5), r.quantile_ms(0.99), r.concurrency, r.in_flight, busy,
                   queue.depth if queue else 0, queue.capacity if queue else 0, dict(r.nodes))


@dataclass(frozen=True)
class QueueStats:
    name: str
    depth: int
    capacity: int
    put_blocked_s: float
    get_blocked_s: float


@dataclass(frozen=True)
class Snapshot:
    """What a Loader (or Session) has done so far: ``stages`` by name in pipeline order, exactly
    the pipeline's; ``source`` and ``queues`` (by ``"producer→consumer"``) apart."""

    runner: str
    running: bool
    elapsed_s: float
    items_out: int
    stages: Mapping[str, StageStats]
    source: StageStats | None = None
    queues: Mapping[str, QueueStats] = field(default_factory=dict)
    #: the training step's figures (a StepClock summary) in a Session's snapshot
    step: Any = None

    def table(self) -> pd.DataFrame:
        """One row per stage (source first)."""
        frame = pd.DataFrame([asdict(s) for s in self._rows()])
        return frame.set_index("name") if not frame.empty else frame

    def to_dict(self) -> dict[str, Any]:
        """Plain data (a row per stage, source first, ``nodes`` only for a runner across nodes,
        ray; the step's figures), as sent to viewers."""
        stages = [{k: v for k, v in asdict(s).items() if k != "nodes" or v} for s in self._rows()]
        out = {"runner": self.runner, "running": self.running, "elapsed_s": self.elapsed_s,
               "items_out": self.items_out, "stages": stages}
        if self.step is not None:
            out["step"] = self.step.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], step: Any = None) -> Snapshot:
        """The Snapshot ``to_dict`` gave (a published run's, received or recorded); ``step`` is
        its step's figures, made by the caller (a StepSummary)."""
        rows = [from_plain(StageStats, row) for row in data.get("stages", [])]
        source = next((r for r in rows if r.kind == "source"), None)
        return cls(runner=str(data.get("runner", "?")), running=bool(data.get("running", False)),
                   elapsed_s=_float(data.get("elapsed_s")), items_out=int(data.get("items_out") or 0),
                   stages={r.name: r for r in rows if r is not source}, source=source, step=step)

    def _rows(self) -> list[StageStats]:
        return ([self.source] if self.source else []) + list(self.stages.values())

    def _repr_html_(self) -> str:
        state = "running" if self.running else "finished"
        head = (f"<p><b>{self.runner}</b> runner, {state}, {self.elapsed_s:.2f} s, "
                f"{self.items_out} outputs</p>")
        cols = ["kind", "tasks", "failures", "qps", "p50_ms", "p99_ms", "concurrency", "queue_depth",
                "queue_capacity", "busy_frac"]
        table = self.table()
        return head + (table[cols].to_html(float_format=_cell) if not table.empty else "")

    def __repr__(self) -> str:
        lines = [f"Snapshot(runner={self.runner!r}, running={self.running}, "
                 f"elapsed_s={self.elapsed_s:.2f}, items_out={self.items_out})"]
        for s in self._rows():
            lines.append(f"  {s.name:<14} {s.kind:<6} tasks={s.tasks:<8} qps={_cell(s.qps):>8} "
                         f"p50={_ms(s.p50_ms):>7} p99={_ms(s.p99_ms):>7} conc={s.concurrency:<3} "
                         f"queue={s.queue_depth}/{s.queue_capacity}")
        return "\n".join(lines)


def from_plain(cls: type, row: Mapping[str, Any]) -> Any:
    """A StageStats or StepSummary from its row of plain data (received or recorded): a missing or
    null figure reads NaN (0 for a count, "" for a name)."""
    values = {}
    for f in fields(cls):
        value = row.get(f.name)
        if f.name == "nodes":  # a count per node; anything else in a row is dropped
            counts = value if isinstance(value, Mapping) else {}
            values["nodes"] = {str(k): v for k, v in counts.items()
                               if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
        elif f.type == "str":
            values[f.name] = str(value if value is not None else "")
        elif f.type == "int":
            values[f.name] = int(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0
        else:
            values[f.name] = _float(value)
    return cls(**values)


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}µs" if x < 1 else f"{x:.1f}ms"
