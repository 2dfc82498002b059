"""The limiting stage and where advice is given, on synthetic diagnoses (no timing)."""

from __future__ import annotations

import math

from spdl_lab._diagnose.measure import _only_where_it_counts
from spdl_lab._diagnose.result import Diagnosis, Point, StageDiagnosis


def stage(name: str, qps: dict[int, float], *, concurrency: int, per_input: int = 1, verdict: str = "scales",
          advice: str = "set concurrency to 8") -> StageDiagnosis:
    points = tuple(Point(stage=name, executor="thread", concurrency=c, qps=q, qps_spread=0.02, cpu_util=0.1,
                         gil_wait_frac=0.05, runqueue_wait_frac=0.0, p50_ms=1.0, repeats=4)
                   for c, q in qps.items())
    return StageDiagnosis(name=name, kind="map", verdict=verdict, best_concurrency=max(qps),
                          evidence="QPS rose.", recommendation=advice, points=points,
                          concurrency=concurrency, items_per_input=per_input)


def diagnosis(*stages: StageDiagnosis) -> Diagnosis:
    return Diagnosis(pipeline="p", stages={s.name: s for s in stages}, machine={"cpu_cores": 2})


def test_the_slowest_stage_at_its_concurrency_limits_the_pipeline():
    read = stage("read", {1: 20_000, 4: 70_000}, concurrency=4)
    decode = stage("decode", {1: 900, 2: 1_400, 4: 1_500}, concurrency=2, verdict="cpu-bound",
                   advice="concurrency 2 is enough")
    d = diagnosis(read, decode)
    assert d.bottleneck == "decode"
    assert decode.rate_now() == 1_400
    text = d.headline()
    assert text.startswith("'decode' limits the pipeline: 1,400 items/s at its concurrency 2 (cpu-bound)")
    assert "50.0x slower than the next slowest ('read'" in text and "concurrency 2 is enough" in text
    assert list(d.verdicts().index)[0] == "decode"


def test_rates_between_measured_points_and_after_a_batch_compare_like_with_like():
    fetch = stage("fetch", {1: 100, 4: 400}, concurrency=2)  # halfway in log2: 250
    assert math.isclose(fetch.rate_now(), 250)
    collate = stage("collate", {1: 10, 2: 12}, concurrency=1, per_input=16)  # 10 batches/s of 16 items
    assert collate.rate_now() == 160
    assert diagnosis(fetch, collate).bottleneck == "collate"


def test_a_stage_far_faster_than_the_limit_gets_its_verdict_and_no_advice():
    read = stage("read", {1: 20_000, 4: 70_000}, concurrency=4, verdict="contended",
                 advice="find the shared lock (a global RNG such as np.random.*)")
    decode = stage("decode", {1: 900, 2: 1_400}, concurrency=2, verdict="cpu-bound", advice="concurrency 2")
    crop = stage("crop", {1: 2_000, 2: 2_500}, concurrency=2, advice="set concurrency to 2")  # 1.8x: kept
    out = _only_where_it_counts({"read": read, "decode": decode, "crop": crop})
    assert out["read"].verdict == "contended" and out["read"].recommendation == ""
    assert "faster than the limiting stage 'decode'" in out["read"].notes[-1]
    assert out["decode"].recommendation == "concurrency 2"
    assert out["crop"].recommendation == "set concurrency to 2"


def test_failed_stages_lead_and_nothing_measured_says_so():
    failed = StageDiagnosis(name="parse", kind="map", verdict=None, best_concurrency=None,
                            evidence="failed: ValueError on 94 of 100 inputs", recommendation="fix it",
                            status="failed", error="Traceback...\nValueError: corrupt")
    d = diagnosis(failed)
    assert d.bottleneck is None
    assert d.headline().startswith("Stage 'parse' failed")
    assert "failed" in d.summary()
