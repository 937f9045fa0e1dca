"""Reports people look at: ``remat explain --html`` (one self-contained page, rendered by headless Chromium when it
is installed) and ``--snapshot`` (a ``torch.cuda.memory._snapshot()``-style pickle that torch's own memory-viz
functions read)."""

from __future__ import annotations

import copy
import functools
import pickle
import re
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
from torch.cuda import _memory_viz as memory_viz

from remat.analysis.explain import explain
from remat.analysis.html import render_html, write_html
from remat.analysis.snapshot import snapshot_live_bytes, to_memory_snapshot, write_memory_snapshot
from remat.config import ModelConfig
from remat.units import format_bytes

TINY = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                   vocab_size=256)
POLICIES = ["none", "full/uniform/1", "full/uniform/4", "selective/core_attn"]


@functools.cache
def explained():
    return explain(TINY, POLICIES, repeats=0)


class _Collect(HTMLParser):
    """Tags, ids and every URL-bearing attribute of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.ids: set[str] = set()
        self.urls: list[str] = []
        self.policy_rows: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        for key in ("src", "href", "xlink:href", "data"):
            if key in attrs:
                self.urls.append(attrs[key])
        if tag == "tr" and "policy-row" in (attrs.get("class") or ""):
            self.policy_rows.append(attrs["data-policy"])


def test_page_is_self_contained(tmp_path):
    path = write_html(explained(), tmp_path / "report.html")
    text = path.read_text(encoding="utf-8")
    page = _Collect()
    page.feed(text)
    assert text.startswith("<!DOCTYPE html>")
    assert page.urls == [] and "script" not in page.tags and "link" not in page.tags and "img" not in page.tags
    assert re.findall(r"https?://[^\s\"']+", text) == ["http://www.w3.org/2000/svg"] * 2  # the SVG namespaces only
    assert "@import" not in text and "url(" not in text
    assert {"memory-timeline", "policy-table", "peak-breakdown", "formula-table", "explanation"} <= page.ids
    assert page.policy_rows == POLICIES
    assert text.count('class="policy-line"') == len(POLICIES)
    assert text.count('class="peak-marker"') == len(POLICIES)
    assert text.count('class="breakdown-row"') == len(POLICIES)
    for sentence in explained().sentences[:3]:
        assert sentence.split(",")[0].replace("'", "&#x27;") in text


def test_peak_markers_sit_at_each_peak():
    result = explained()
    text = render_html(result)
    for row in result.rows:
        marker = re.search(rf'<circle class="peak-marker" data-policy="{re.escape(row.policy)}"[^>]*>'
                           r"<title>([^<]*)</title>", text)
        assert marker is not None
        assert f"peak {format_bytes(row.peak_bytes)}" in marker.group(1)
        assert row.peak_phase.replace("'", "&#x27;") in marker.group(1)


def test_long_timelines_keep_their_peak():
    from remat.analysis.html import downsample_curve

    y = np.sin(np.linspace(0, 40, 100_000)) + np.linspace(0, 1, 100_000)
    y[54_321] = 9.0
    x = np.linspace(0, 2, len(y))
    rx, ry = downsample_curve(x, y)
    assert len(rx) <= 1500 and ry.max() == 9.0 and np.all(np.diff(rx) > 0)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (CI installs it: .ci/run)")
def test_chromium_renders_the_page(tmp_path):
    path = write_html(explained(), tmp_path / "report.html")
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=180, check=True).stdout
    page = _Collect()
    page.feed(dom)
    assert page.policy_rows == POLICIES
    assert "memory-timeline" in page.ids and "svg" in page.tags and "polyline" in page.tags
    assert dom.count('class="breakdown-row"') == len(POLICIES)
    assert "In plain words" in dom


# ------------------------------------------------------------------------ memory snapshot
@pytest.mark.parametrize("policy", POLICIES)
def test_snapshot_replays_the_timeline(policy):
    tl = explained().timelines[policy]
    snap = to_memory_snapshot(tl)
    live = snapshot_live_bytes(snap)
    assert np.array_equal(live, tl.live_bytes())  # one alloc/free_completed per timeline event, same bytes
    assert live.max() == tl.peak_bytes
    segment = snap["segments"][0]
    assert segment["total_size"] >= tl.peak_bytes
    alive_at_end = int(tl.live_bytes()[-1])
    assert sum(b["requested_size"] for b in segment["blocks"] if b["state"] == "active_allocated") == alive_at_end
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]


def test_torch_memory_viz_reads_the_snapshot(tmp_path):
    tl = explained().timelines["full/uniform/1"]
    snap = to_memory_snapshot(tl)
    path = write_memory_snapshot(tl, tmp_path / "snap.pickle")
    assert path.read_bytes() == pickle.dumps(snap, protocol=4)  # the file is that dict (remat never unpickles)
    # the HTML viewers (pytorch.org/memory_viz embeds the same pickle)
    # (filter_freed edits the dict it is given: it gets a copy)
    for page in (memory_viz.trace_plot(snap), memory_viz.trace_plot(copy.deepcopy(snap), filter_freed=True),
                 memory_viz.segment_plot(snap)):
        assert "add_local_files" in page
    # allocator state at the end: torch's own accounting checks that the blocks tile the segment
    summary = memory_viz.segsum(snap)
    assert "segments: 1" in summary
    # memory(): a flamegraph of the segment's blocks; the raw lines (no flamegraph.pl) add up to the segment
    lines = memory_viz.memory(snap, format_flamegraph=lambda text: text).splitlines()
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == snap["segments"][0]["total_size"]
    assert any("module:0:head.output_layer.weight" in line or "head.output_layer" in line for line in lines)
    assert memory_viz.trace(snap).startswith("Device 0")
    # the frames name the phase and the module of each allocation
    peak_event = tl.peak_event
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    names = {f["name"] for e in allocs for f in e["frames"]}
    assert any(n.startswith("recompute layer") for n in names) and any(n.startswith("forward layer") for n in names)
    assert "policy full/uniform/1" in names
    assert max(snapshot_live_bytes(snap)) == tl.live_bytes()[peak_event] == tl.peak_bytes
