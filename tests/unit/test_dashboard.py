"""What the operator's trial missed on the dashboard: the overview shows the queue's length beside its lag (a
backlog read into the workers' prefetch has no lag) and the p95 per lane; GPU busy and fan-outs have panels; the
queue panels count the exporter's series (no worker selector on them)."""

import json
from pathlib import Path

BOARD = json.loads((Path(__file__).resolve().parents[2] / "ops/grafana/dashboards/decision-queue.json").read_text())


def row(title: str) -> list[dict]:
    panels, inside = [], False
    for panel in BOARD["panels"]:
        if panel["type"] == "row":
            inside = panel["title"] == title
        elif inside:
            panels.append(panel)
    return panels


def exprs(panel: dict) -> str:
    return " ".join(t["expr"] for t in panel.get("targets", []))


def test_the_overview_shows_length_beside_lag_and_p95_per_lane():
    overview = {p["title"]: p for p in row("Overview")}
    queue = exprs(next(p for title, p in overview.items() if "lag" in title.lower()))
    assert "dq_stream_length" in queue and "dq_stream_lag" in queue
    p95 = next(p for p in overview.values() if "histogram_quantile(0.95" in exprs(p))
    assert "lane" in exprs(p95) and "{{lane}}" in p95["targets"][0]["legendFormat"]


def test_gpu_busy_and_fan_outs_have_panels():
    by_title = {p["title"]: exprs(p) for p in BOARD["panels"] if p["type"] != "row"}
    busy = next(e for t, e in by_title.items() if "gpu busy" in t.lower())
    assert "dq_pack_gpu_seconds_sum" in busy and "dq_gpu_idle_seconds_sum" in busy
    assert any("dq_fanouts_total" in e for t, e in by_title.items() if "fan-out" in t.lower())


def test_queue_gauges_count_the_exporters_series_too():
    for panel in BOARD["panels"]:
        for target in panel.get("targets", []):
            if any(f"{m}{{" in target["expr"] or f"{m})" in target["expr"]
                   for m in ("dq_stream_lag", "dq_stream_length", "dq_stream_pending")):
                assert "$instance" not in target["expr"], panel["title"]
