"""A Comparison as text (at most 100 columns) and as an HTML fragment, warnings included.

Columns that do not apply are left out: no device, no ``device_util``; a step
that is not a SimulatedDevice, no training-thread waits. A runner that beat the
headspace beyond the noise shows "not trustworthy" instead of its ratio.
"""

from __future__ import annotations

import html
import math
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from .compare import Comparison

__all__ = ["WIDTH", "columns", "html_table", "text_table"]

WIDTH = 100
_UNTRUSTED = "not trustworthy"

Cell = Callable[[pd.Series], str]


def _pct(col: str) -> Cell:
    return lambda row: "-" if math.isnan(row[col]) else f"{row[col]:.0%}"


def _num(col: str, fmt: str) -> Cell:
    return lambda row: "-" if math.isnan(row[col]) else format(row[col], fmt)


def _rate(row: pd.Series) -> str:
    lo, hi = row["batches_per_s_lo"], row["batches_per_s_hi"]
    spread = "" if math.isnan(lo) or lo == hi else f" [{lo:.3g}-{hi:.3g}]"
    return f"{row['batches_per_s']:.3g}{spread}"


def _vs_cache(cmp: Comparison) -> Cell:
    def cell(row: pd.Series) -> str:
        if math.isnan(row["vs_cache"]):
            return "-"
        if not cmp.trustworthy(row.name):
            return _UNTRUSTED
        lo, hi = row["vs_cache_lo"], row["vs_cache_hi"]
        spread = "" if lo == hi else f" [{lo:.2f}-{hi:.2f}]"
        return f"{row['vs_cache']:.2f}x{spread}"
    return cell


def columns(cmp: Comparison) -> list[tuple[str, Cell]]:
    """(heading, cell) of the columns that apply to this comparison, most important first."""
    table = cmp.table
    cols: list[tuple[str, Cell]] = [("batches/s [lo-hi]", _rate)]
    if table["vs_cache"].notna().any():
        cols.append(("vs cache [lo-hi]", _vs_cache(cmp)))
    cols += [("step p50 ms", _num("step_p50_ms", ".1f")), ("data wait", _pct("data_wait_frac"))]
    optional = [
        ("device", "device_util", _pct("device_util")),
        ("train GIL", "train_gil_wait_frac", _pct("train_gil_wait_frac")),
        ("CPU %", "cpu_percent", _num("cpu_percent", ".0f")),
        ("GIL wait", "gil_wait_frac", _pct("gil_wait_frac")),
        ("others CPU %", "others_cpu_percent", _num("others_cpu_percent", ".0f")),
    ]
    cols += [(head, cell) for head, col, cell in optional if table[col].notna().any()]
    return cols


def text_table(cmp: Comparison) -> str:
    cols = columns(cmp)
    while True:
        lines = _lines(cmp, cols)
        if max(map(len, lines)) <= WIDTH or len(cols) <= 3:
            break
        cols = cols[:-1]  # the least important column goes first
    out = textwrap.wrap(cmp.header(), WIDTH) + lines
    if cmp.warnings:
        out.append("warnings:")
        for warning in cmp.warnings:
            out += textwrap.wrap(warning, WIDTH, initial_indent="- ", subsequent_indent="  ")
    return "\n".join(out)


def _lines(cmp: Comparison, cols: list[tuple[str, Cell]]) -> list[str]:
    names = [str(r) for r in cmp.table.index]
    cells = [[cell(row) for _, cell in cols] for _, row in cmp.table.iterrows()]
    widths = [max(len(head), *(len(c[i]) for c in cells)) for i, (head, _) in enumerate(cols)]
    first = max(len("runner"), *map(len, names))
    lines = ["  ".join(["runner".ljust(first)] + [h.rjust(w) for (h, _), w in zip(cols, widths)])]
    for name, row in zip(names, cells):
        lines.append("  ".join([name.ljust(first)] + [c.rjust(w) for c, w in zip(row, widths)]))
    return lines


def html_table(cmp: Comparison) -> str:
    cols = columns(cmp)
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _ in cols)
    body = "".join(
        f"<tr><td>{html.escape(str(name))}</td>" + "".join(f"<td>{html.escape(cell(row))}</td>" for _, cell in cols)
        + "</tr>"
        for name, row in cmp.table.iterrows()
    )
    warnings = ""
    if cmp.warnings:
        items = "".join(f"<li>{html.escape(w)}</li>" for w in cmp.warnings)
        warnings = f'<div class="warnings"><b>warnings</b><ul>{items}</ul></div>'
    return (f"<p><b>{html.escape(cmp.header())}</b></p>{warnings}"
            f"<table><tr><th>runner</th>{head}</tr>{body}</table>")
