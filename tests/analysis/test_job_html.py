"""The job page: ``remat predict --html`` / ``remat plan --html`` of a whole Megatron job (one self-contained page,
rendered by headless Chromium when it is installed): its numbers are the JSON's, its schedule is the step's, a job
with too many distinct ranks is grouped, and a bad ``--html`` is refused before the work."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from remat.analysis.job_html import MAX_BARS, OVERHEAD, Answer, group_ranks, render_job_html
from remat.analysis.job_step import in_flight_steps, schedule_bands
from remat.cli import main
from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_predict import PARTS, RankPrediction, predict_job
from remat.policy import Policy
from remat.timeline import Phase, Timeline

SMALL = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "2", "--vocab", "256"]
JOB = [*SMALL, "--tp", "2", "--sp", "--pp", "2", "--microbatches", "4", "--dp", "2", "--distributed-optimizer"]
POLICIES = "none,full/uniform/1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Page(HTMLParser):
    """Every element's tag and attributes, in document order."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def having(self, cls: str, tag: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.elements if cls in a.get("class", "").split() and tag in (None, t)]


def _rank_rows(page: _Page) -> list[dict[str, int | str]]:
    return [{"policy": a["data-policy"], "rank": int(a["data-rank"]), "stage": int(a["data-stage"]),
             "ranks_alike": int(a["data-ranks-alike"]), "peak_bytes": int(a["data-peak-bytes"]),
             **{p: int(a[f"data-{p}"]) for p in PARTS}} for a in page.having("rank-row", "tr")]


def _json_rows(report: dict) -> list[dict[str, int | str]]:
    return [{k: row[k] for k in ("policy", "rank", "stage", "ranks_alike", "peak_bytes", *PARTS)}
            for row in report["rows"]]


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """``remat predict`` of a small job, two policies: (JSON report, text, page path)."""
    folder = tmp_path_factory.mktemp("job-page")
    page, out = folder / "job.html", folder / "job.json"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["predict", *JOB, "--policy", POLICIES, "--gpu", "h100-80g", "--html", str(page),
                     "--out", str(out)]) == 0
    return json.loads(out.read_text()), text.getvalue(), page


def test_page_numbers_equal_the_json(predicted):
    report, text, path = predicted
    html = path.read_text(encoding="utf-8")
    page = _Page(html)
    assert _rank_rows(page) == _json_rows(report)  # every distinct rank of every policy, to the byte
    for row in _rank_rows(page):  # each bar's parts add up to the rank's peak
        assert sum(row[p] for p in PARTS) == row["peak_bytes"]
    # the caching allocator's replay (GPU kernels: every job prediction has it): reserved = the bar's whole length
    for attrs, row in zip(page.having("rank-row", "tr"), report["rows"]):
        if row.get("reserved"):
            reserved = row["reserved"]["max_memory_reserved"]
            assert int(attrs["data-max-memory-reserved"]) == reserved
            assert int(attrs[f"data-{OVERHEAD}"]) == reserved - row["peak_bytes"]
        else:
            assert "data-max-memory-reserved" not in attrs
    worst = {}
    for row in report["rows"]:
        worst.setdefault(row["policy"], row["peak_bytes"])  # worst rank first
    assert {a["data-policy"]: int(a["data-peak-bytes"]) for a in page.having("policy-row")} == worst
    capacity = {int(a["data-bytes"]) for a in page.having("capacity", "line")}
    assert capacity == {report["gpu"]["capacity_bytes"]} and report["gpu"]["name"] == "h100-80g"
    assert report["files"]["html"] == str(path)
    assert f"page: {path}" in text and "against h100-80g" in text
    # self-contained: no script, no stylesheet or image fetched, no URL but the SVG namespace
    assert not {"script", "link", "img", "iframe"} & {t for t, _ in page.elements}
    assert set(re.findall(r"https?://[^\s\"']+", html)) == {"http://www.w3.org/2000/svg"}
    assert "url(" not in html and "@import" not in html
    # per policy: the rank bars, the worst rank through the step with its schedule, the tensors at its peak
    assert len(page.having("rank-bars", "svg")) == len(page.having("step-chart", "svg")) == 2
    assert len(page.having("peak-tensors", "table")) == 2 and page.having("tensor-row", "tr")


def test_peak_marker_and_tensors_are_the_worst_ranks():
    job = _small_job()
    pred = predict_job(job, kernels="cpu")
    w = pred.worst
    page = _Page(render_job_html("t", [], [Answer("none", pred.ranks)]))
    marker = page.having("peak-marker", "circle")[0]
    assert int(marker["data-bytes"]) == w.peak_bytes and int(marker["data-event"]) == w.timeline.peak_event
    tensors = [(int(a["data-bytes"]), int(a["data-count"])) for a in page.having("tensor-row", "tr")]
    listed = sum(n * c for n, c in tensors)
    largest = sorted((w.timeline.nbytes[i] for i in w.timeline.alive_at(w.timeline.peak_event)), reverse=True)
    assert tensors[0][0] == largest[0] and listed == sum(largest[:sum(c for _, c in tensors)])


@functools.cache
def _small_job(vpp: int | None = None) -> Job:
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                         vocab_size=256)
    return Job.build(config, precision="bf16", tp=2, sp=True, pp=2, vpp=vpp, dp=2, num_microbatches=4,
                     schedule="interleaved" if vpp else "1f1b", distributed_optimizer=True,
                     policy=Policy.parse("full/uniform/1"))


@pytest.mark.parametrize("vpp", [None, 2])
def test_schedule_bands_are_the_steps(vpp):
    job = _small_job(vpp)
    for rank in predict_job(job, kernels="cpu").ranks:
        tl = rank.timeline
        bands = schedule_bands(tl)
        chunks = sorted({b[4] for b in bands if b[2] != "optimizer"})
        assert len(chunks) == (vpp or 1)
        for kind in ("F", "B"):  # each microbatch's forward and backward on each of the rank's chunks
            assert sorted({(b[3], b[4]) for b in bands if b[2] == kind}) == \
                [(mb, c) for mb in range(job.num_microbatches) for c in chunks]
        assert bands[-1][2] == "optimizer" and bands[-1][1] == tl.num_events  # the step ends with it
        most = max(c for _, c in in_flight_steps(tl, bands))
        assert most == tl.meta["pipeline"]["max_in_flight"]
        page = _Page(render_job_html("t", [], [Answer("p", [rank])]))
        assert len(page.having("band", "rect")) == len(bands)
        assert int(page.having("in-flight", "polyline")[0]["data-max"]) == most


def _tiny_rank(stage: int, activations: int, ranks: int = 8) -> RankPrediction:
    phases = [Phase(0, "setup", ""), Phase(1, "forward", "layer 0", "microbatch 0, chunk 0"),
              Phase(2, "backward", "layer 0", "microbatch 0, chunk 0")]
    tl = Timeline(nbytes=[1000, activations], alloc_at=[0, 1], free_at=[-1, 2], phase_index=[0, 1],
                  module=["ddp.param_buffer", "layers.0.mlp"], category=["parameters", "saved_activations"],
                  phases=phases, num_events=3)
    return RankPrediction(stage, stage * 8, ranks, None, tl)  # type: ignore[arg-type]


def test_many_distinct_ranks_are_grouped():
    ranks = [_tiny_rank(s, 100 + s) for s in range(3000)]  # every rank its own peak
    bars, grouped = group_ranks(ranks)
    assert grouped and len(bars) <= MAX_BARS
    assert bars[0].ranks == [ranks[-1]]  # the worst keeps a bar of its own
    assert sum(b.ranks_alike for b in bars) == 8 * 3000
    assert sorted(r.stage for b in bars for r in b.ranks) == list(range(3000))
    page_text = render_job_html("t", [], [Answer("p", ranks)])
    page = _Page(page_text)
    rows = page.having("rank-row", "tr")
    assert len(rows) == len(bars) and sum(int(a["data-ranks-alike"]) for a in rows) == 8 * 3000
    assert "3,000 distinct ranks are too many to draw one bar each" in page_text
    # alike ranks (the same parts) share a bar before any is merged by peak
    alike = [_tiny_rank(s, 100 + s % 3) for s in range(3000)]
    bars, grouped = group_ranks(alike)
    assert grouped and [len(b.ranks) for b in bars] == [1000, 1000, 1000]
    assert not group_ranks(ranks[:MAX_BARS])[1]


def test_reserved_figures_are_drawn_when_present():
    rank = _tiny_rank(0, 500)
    rank.reserved = {"max_memory_reserved": 4096, "max_memory_allocated": 1500,
                     "fragmentation_at_peak_bytes": 2596, "largest_free_block_bytes": 2048}
    page = _Page(render_job_html("t", [], [Answer("p", [rank])], capacity=[("gpu", 5000)]))
    overhead = [a for a in page.having("part", "rect") if a["data-part"] == OVERHEAD]
    assert [int(a["data-bytes"]) for a in overhead] == [4096 - 1500]
    row = page.having("rank-row", "tr")[0]
    assert int(row["data-max-memory-reserved"]) == 4096 and int(row["data-largest-free-block-bytes"]) == 2048
    assert int(row[f"data-{OVERHEAD}"]) == 4096 - 1500
    # a rank below the worst allocated peak that reserves more is the one a GPU runs out of first: named
    other = _tiny_rank(1, 400)
    other.reserved = {**rank.reserved, "max_memory_reserved": 8192}
    text = render_job_html("t", [], [Answer("p", [rank, other])], capacity=[("gpu", 5000)])
    assert "◀ most reserved" in text and "rank 8 (stage 1) reserves the most: 8.00 KiB: 164% of gpu" in text
    without = _Page(render_job_html("t", [], [Answer("p", [_tiny_rank(0, 500)])]))
    assert not [a for a in without.having("part", "rect") if a["data-part"] == OVERHEAD]


@pytest.mark.parametrize("argv", [
    ["predict", *JOB, "--html", "/proc/x.html"],
    ["plan", *JOB, "--budget", "1GiB", "--html", "/"],
], ids=["predict", "plan"])
def test_an_unwritable_html_is_refused_before_the_work(monkeypatch, capsys, argv):
    import remat.cli.job as cli_job

    def work(*args, **kwargs):
        raise AssertionError("the work ran before --html was checked")

    monkeypatch.setattr(cli_job, "predict_policies", work)
    monkeypatch.setattr(cli_job, "plan_job", work)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("remat: error: --html ") and err.count("\n") == 1, err


def test_plan_page_numbers_equal_the_json(tmp_path, capsys):
    page_path = tmp_path / "plan.html"
    code = main(["plan", *SMALL, "--layers", "2", "--pp", "2", "--microbatches", "2", "--dp", "2",
                 "--distributed-optimizer", "--budget", "1GiB", "--operator-sets", "0", "--no-offload", "--json",
                 "--html", str(page_path)])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["fits"] and report["files"]["html"] == str(page_path)
    page = _Page(page_path.read_text(encoding="utf-8"))
    rows = {a["data-policy"]: [] for a in page.having("rank-row", "tr")}
    for a in page.having("rank-row", "tr"):
        rows[a["data-policy"]].append({"rank": int(a["data-rank"]), "stage": int(a["data-stage"]),
                                       "peak_bytes": int(a["data-peak-bytes"]),
                                       **{p: int(a[f"data-{p}"]) for p in PARTS}})
    keys = ("rank", "stage", "peak_bytes", *PARTS)
    stages = sorted(({k: s[k] for k in keys} for s in report["stages"]), key=lambda r: (-r["peak_bytes"], r["stage"]))
    assert rows["per-stage plans"] == stages
    uniform = report["uniform"]
    assert rows[f"one Megatron setting: {uniform['policy']}"] == [{k: r[k] for k in keys} for r in uniform["rows"]]
    assert [int(a["data-bytes"]) for a in page.having("capacity", "line")][-1] == report["budget_bytes"]
    chart = {a["data-policy"]: int(a["data-peak-bytes"]) for a in page.having("policy-row", "tr")}
    assert chart["per-stage plans"] == stages[0]["peak_bytes"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (CI installs it: .ci/run)")
def test_chromium_renders_the_job_page(predicted, tmp_path):
    report, _, path = predicted
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=180, check=True)
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []  # an SVG attribute Chromium cannot read, a script error, ... would be logged there
    page = _Page(run.stdout)
    assert _rank_rows(page) == _json_rows(report)  # the numbers the browser shows are the JSON's
    tags = {t for t, _ in page.elements}
    assert {"svg", "polyline", "rect", "circle", "details"} <= tags
    assert page.having("rank-bars", "svg") and page.having("step-chart", "svg") and page.having("band", "rect")


def test_a_plan_whose_model_state_does_not_fit_shows_the_state():
    state = {"parameters": 4 << 30, "gradients": 8 << 30, "master_parameters": 2 << 30, "optimizer_state": 4 << 30}
    answer = Answer("model state alone", [], "the model state does not fit before any activation",
                    [(0, state), (1, state)])
    page = _Page(render_job_html("t", [], [answer], capacity=[("budget 10 GiB", 10 << 30)]))
    assert [a["data-stage"] for a in page.having("state-row", "tr")] == ["0", "1"]
    assert not page.having("rank-row") and not page.having("step-chart")
