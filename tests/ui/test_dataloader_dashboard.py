"""The dashboard of a DataLoader run: its workers' stages and queue are drawn, a plot with nothing
to draw says why in one line, and the CPU plot has a legend entry only for lines it can draw."""

from __future__ import annotations

import time

import pytest
import torch
from bokeh.models import Legend
from torch.utils.data import DataLoader, Dataset

import spdl_lab as lab
from spdl_lab._integrations.torch_dataloader import QUEUE
from spdl_lab._ui.live_plots import LivePlots, column_name

pytestmark = pytest.mark.usefixtures("no_thread_leak", "no_child_leak")


class Numbers(Dataset):
    def __len__(self) -> int:
        return 4000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def step(batch) -> None:
    time.sleep(0.005)  # a training step's length, so the run outlasts the dashboard's first draws


def legend_labels(fig) -> list[str]:
    return [item.label.value for legend in fig.right if isinstance(legend, Legend) for item in legend.items]


@pytest.mark.timeout(120)
def test_a_dataloaders_stages_and_queue_are_drawn_with_a_row_per_worker(wait_until):
    dl = DataLoader(Numbers(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    session = lab.run(dl, step=step, duration=60)
    dash = session.dashboard()
    try:
        drawn = lambda: (dash.plots is not None and {"fetch", "collate"} <= set(dash.plots.stages)  # noqa: E731
                         and QUEUE in dash.plots.queues)
        assert wait_until(drawn, 60), dash.plots and (dash.plots.stages, dash.plots.queues)
        assert not dash.plots.notes
        assert column_name("qps", "fetch") in dash.plots.source.data
        assert {"fetch", "collate", QUEUE} <= set(legend_labels(dash.plots.figures[0])) | set(
            legend_labels(dash.plots.figures[1]))
        dash.publish()
        assert wait_until(lambda: "fetch/worker1" in dash.table.value, 10), dash.table.value
    finally:
        session.stop()
        dash.close()


@pytest.mark.timeout(60)
def test_a_dataloader_without_workers_says_why_it_has_no_stage_plot(wait_until):
    dl = DataLoader(Numbers(), batch_size=4, num_workers=0)
    session = lab.run(dl, step=step, duration=60)
    dash = session.dashboard()
    try:
        notes = lambda: " ".join(n.text for n in dash.plots.notes) if dash.plots is not None else ""  # noqa: E731
        assert wait_until(lambda: "num_workers=0" in notes(), 20), notes()
        assert len(dash.plots.notes) == 2 and len(dash.plots.figures) == 3  # text in place of two plots
        assert "loop's thread" in notes()
    finally:
        session.stop()
        dash.close()


def test_a_plot_with_nothing_to_draw_is_one_line_of_text_and_cpu_lines_without_data_have_no_legend():
    plots = LivePlots([], [], cpu=["main", "total", "machine"],
                      why_empty={"stages": "no stage meters: <because>", "queues": "no queue: none"})
    assert [n.text for n in plots.notes] == ["no stage meters: &lt;because&gt;", "no queue: none"]
    cpu = next(f for f in plots.figures if f.title.text.startswith("CPU"))
    assert "child processes" not in legend_labels(cpu)
    assert legend_labels(cpu) == ["this process", "total", "whole machine"]
    assert column_name("cpu_percent", "children") not in plots.source.data
    every = LivePlots(["read"], ["read→output"])
    assert "child processes" in legend_labels(next(f for f in every.figures if f.title.text.startswith("CPU")))
    assert not every.notes and len(every.figures) == 5
