"""Tests for remat.measure (the CPU step recorder) and remat.timeline (the table it fills, and its JSON file)."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from remat.config import ModelConfig
from remat.memory.measure import MeasureError, measure
from remat.models.gpt import build_model, sample_batch
from remat.policy import Policy
from remat.recompute.apply import apply
from remat.timeline import CATEGORIES, Phase, Timeline, TimelineError

SMALL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                    vocab_size=128)
EIGHT = SMALL.replace(num_layers=8)
# Logits (b*s*V*4 bytes = 8 MiB, then their gradient) dwarf one layer's activations (about 2 MiB).
BIG_VOCAB = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=4,
                        vocab_size=8192)
TINY_VOCAB = BIG_VOCAB.replace(vocab_size=16)

SUM_POLICIES = ["none", "full/uniform/1", "full/uniform/2@non-reentrant", "full/uniform/4", "full/block/2",
                "selective/core_attn+mlp", "selective/layernorm+act@non-reentrant"]


@functools.cache
def measured(cfg: ModelConfig, policy: str) -> tuple[nn.Module, Timeline]:
    """One measured step per (config, policy), shared by the tests of this module."""
    model = build_model(cfg, seed=0)
    apply(model, policy)
    torch.manual_seed(0)
    return model, measure(model, sample_batch(cfg))


def end_of_forward(tl: Timeline) -> int:
    """The last event before backward starts."""
    return next(p.start for p in tl.phases if p.kind == "backward") - 1


def layer_activation_bytes(plain: Timeline) -> dict[int, int]:
    """Bytes alive at the end of forward that were allocated in the forward of each layer (a plain run)."""
    out: dict[int, int] = {}
    for row in plain.alive_at(end_of_forward(plain)):
        phase = plain.phases[plain.phase_index[row]]
        if phase.kind == "forward" and phase.region.startswith("layer "):
            i = int(phase.region.split()[1])
            out[i] = out.get(i, 0) + plain.nbytes[row]
    return out


def storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


# ------------------------------------------------------------------------ against PyTorch's MemTracker
@pytest.mark.filterwarnings("ignore:The module hierarchy tracking")
@pytest.mark.parametrize("policy", ["none", "full/uniform/1", "full/uniform/4", "full/block/2",
                                    "selective/core_attn+mlp"])
def test_peak_matches_memtracker(policy):
    from torch.distributed._tools.mem_tracker import MemTracker

    _, tl = measured(SMALL, policy)
    assert tl.meta["backend"] == "cpu"
    model = build_model(SMALL, seed=0)
    apply(model, policy)
    batch = sample_batch(SMALL)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    mt = MemTracker()
    mt.track_external(model)
    with mt:
        loss = model(*batch)
        loss.backward()
    peak = sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values())
    assert peak > 0
    assert abs(tl.peak_bytes - peak) <= 0.01 * peak, (tl.peak_bytes, peak)
    assert tl.meta["loss"] == loss.item()


# ------------------------------------------------------------------------ the parts add up
@pytest.mark.parametrize("policy", SUM_POLICIES)
def test_parts_add_up(policy):
    _, tl = measured(SMALL, policy)
    assert sum(tl.at_peak.values()) == tl.peak_bytes > 0
    assert set(tl.at_peak) == set(CATEGORIES)
    live = tl.live_bytes()
    assert len(live) == tl.num_events and live.max() == tl.peak_bytes and live[tl.peak_event] == tl.peak_bytes
    n = tl.num_events
    for t in sorted({0, n // 5, n // 3, n // 2, 2 * n // 3, tl.peak_event, n - 1}):
        assert sum(tl.breakdown(t).values()) == live[t]
        rows = tl.alive_at(t)
        assert sum(tl.nbytes[r] for r in rows) == live[t]


@pytest.mark.parametrize("policy", SUM_POLICIES)
def test_table_is_consistent(policy):
    _, tl = measured(SMALL, policy)
    freed = [f for f in tl.free_at if f != -1]
    # every event is one allocation or one free
    assert tl.num_events == len(tl) + len(freed)
    assert sorted(tl.alloc_at + freed) == list(range(tl.num_events))
    assert all(f == -1 or f > a for a, f in zip(tl.alloc_at, tl.free_at))
    assert all(b > 0 for b in tl.nbytes)
    assert [p.start for p in tl.phases] == sorted(p.start for p in tl.phases)
    for row in range(len(tl)):
        assert tl.phase_at(tl.alloc_at[row]) == tl.phases[tl.phase_index[row]]


@pytest.mark.parametrize("policy", SUM_POLICIES)
def test_no_activation_outlives_the_step(policy):
    model, tl = measured(SMALL, policy)
    end = tl.breakdown(tl.num_events - 1)
    assert end["saved_activations"] == end["recompute"] == end["group_inputs"] == 0
    assert end["parameters"] == storage_bytes(model.parameters())
    assert end["gradients"] == storage_bytes(p.grad for p in model.parameters())


# ------------------------------------------------------------------------ the user's formula (question.md)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_recompute_working_set_is_stored_inputs_plus_the_groups_activations(k):
    """At the end of the last group's recomputation: stored inputs + that group's full activations."""
    _, plain = measured(EIGHT, "none")
    per_layer = layer_activation_bytes(plain)
    assert sorted(per_layer) == list(range(8)) and min(per_layer.values()) > 0
    _, tl = measured(EIGHT, f"full/uniform/{k}")
    last = Policy.parse(f"full/uniform/{k}").layer_groups(8)[-1]
    label = tl.meta["regions"][-1]
    spans = tl.phase_spans()
    first = next(i for i, (p, _, _) in enumerate(spans) if p.kind == "recompute")
    assert spans[first][0].detail == label  # backward recomputes the last group first
    assert spans[first][0].region == f"layer {last[0]}"
    i = first
    while i + 1 < len(spans) and spans[i + 1][0].kind == "recompute" and spans[i + 1][0].detail == label:
        i += 1
    assert [spans[j][0].region for j in range(first, i + 1)] == [f"layer {j}" for j in last]
    event = spans[i][2] - 1
    at = tl.breakdown(event)
    stored = tl.breakdown(end_of_forward(tl))["group_inputs"]
    assert stored > 0
    expected = stored + sum(per_layer[j] for j in last)
    assert at["group_inputs"] + at["recompute"] == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_stored_group_inputs(k):
    _, tl = measured(EIGHT, f"full/uniform/{k}")
    hidden = EIGHT.micro_batch_size * EIGHT.seq_length * EIGHT.hidden_size * 4  # fp32 [b, s, h]
    mask = EIGHT.seq_length ** 2  # bool [1, 1, s, s], one tensor given to every group
    # each of the 8/k groups keeps its input hidden state; the mask is stored once
    assert tl.breakdown(end_of_forward(tl))["group_inputs"] == (8 // k) * hidden + mask


# ------------------------------------------------------------------------ the whole-stack answer
def test_whole_stack_group_saves_memory_when_logits_dominate():
    _, plain = measured(BIG_VOCAB, "none")
    _, whole = measured(BIG_VOCAB, "full/uniform/4")
    none_at, whole_at = plain.at_peak, whole.at_peak
    # premise: the head's tensors at the peak outweigh one layer's activations
    assert none_at["head_loss"] > max(layer_activation_bytes(plain).values())
    # without recompute the peak is where the logits' backward meets every layer's saved activations
    assert none_at["head_loss"] > 0 and none_at["saved_activations"] > 0
    assert whole.peak_bytes < plain.peak_bytes
    # ... and k = L saves the activations that coexisted with the head, less what its checkpoint keeps
    saving = none_at["saved_activations"] - whole_at["saved_activations"] - whole_at["group_inputs"]
    assert plain.peak_bytes - whole.peak_bytes == pytest.approx(saving, abs=0.01 * plain.peak_bytes)
    assert not (whole_at["head_loss"] > 0.01 * whole.peak_bytes and whole_at["recompute"] > 0.01 * whole.peak_bytes)


def test_whole_stack_group_saves_nothing_with_a_tiny_vocabulary():
    _, plain = measured(TINY_VOCAB, "none")
    _, whole = measured(TINY_VOCAB, "full/uniform/4")
    assert abs(whole.peak_bytes - plain.peak_bytes) <= 0.03 * plain.peak_bytes
    at = whole.at_peak
    assert not (at["head_loss"] > 0.01 * whole.peak_bytes and at["recompute"] > 0.01 * whole.peak_bytes)
    assert whole.peak_phase.kind in ("backward", "recompute")  # the recomputed stack is the peak


# ------------------------------------------------------------------------ exactness on a hand-made case
class Allocator(nn.Module):
    """Allocates known sizes: ``keep`` (n float32) stays saved for backward, ``tmp`` (3n float64) dies."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.empty(self.n, dtype=torch.float32).fill_(0.5)
        grid = keep.view(10, self.n // 10)  # a view shares keep's storage
        tmp = torch.empty(3 * self.n, dtype=torch.float64).fill_(1.0)
        del tmp
        return x + (grid[0] * self.scale).sum()  # mul saves grid[0], a view of keep


class AllocModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Allocator(1000), Allocator(250)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_exact_bytes_on_a_hand_made_model():
    model = AllocModel()
    tl = measure(model, (torch.zeros(4),))
    spans = {p.label: (s, e) for p, s, e in tl.phase_spans()}
    backward_start = next(p.start for p in tl.phases if p.kind == "backward")
    for i, n in enumerate((1000, 250)):
        start, end = spans[f"forward layer {i}"]
        rows = [r for r in range(len(tl)) if start <= tl.alloc_at[r] < end]
        assert all(tl.module[r] == f"layers.{i}" for r in rows)
        sizes = sorted(tl.nbytes[r] for r in rows)
        keep = [r for r in rows if tl.nbytes[r] == 4 * n]
        tmp = [r for r in rows if tl.nbytes[r] == 24 * n]
        assert len(keep) == 1 and len(tmp) == 1, sizes  # the view made no row of its own
        assert start < tl.free_at[tmp[0]] < end  # freed within the layer's forward
        assert tl.free_at[keep[0]] == -1 or tl.free_at[keep[0]] > backward_start  # kept for backward
        assert tl.category[keep[0]] == "saved_activations"
    assert tl.breakdown(backward_start - 1)["parameters"] == 2 * 4


def test_freed_storages_have_free_at():
    _, tl = measured(SMALL, "none")
    alive_at_end = [r for r in range(len(tl)) if tl.free_at[r] == -1]
    # what is alive at the end of the step: parameters, gradients, the loss, the batch
    assert sum(tl.nbytes[r] for r in alive_at_end) == tl.live_bytes()[-1]
    assert {tl.category[r] for r in alive_at_end} <= {"parameters", "gradients", "head_loss", "other"}


# ------------------------------------------------------------------------ phases
def phase_sequence(tl: Timeline) -> list[str]:
    return [p.label for p in tl.phases]


@pytest.mark.parametrize("engine", ["reentrant", "non-reentrant"])
def test_phase_order_uniform_2(engine):
    _, tl = measured(SMALL, f"full/uniform/2@{engine}")
    g0, g1 = "group 0 (layers 0-1)", "group 1 (layers 2-3)"
    assert tl.meta["regions"] == [g0, g1]
    assert phase_sequence(tl) == [
        "setup", "forward embedding",
        "forward layer 0", "forward layer 1", "forward layer 2", "forward layer 3", "forward head",
        "backward head",
        f"recompute layer 2 [{g1}]", f"recompute layer 3 [{g1}]", "backward layer 3", "backward layer 2",
        f"recompute layer 0 [{g0}]", f"recompute layer 1 [{g0}]", "backward layer 1", "backward layer 0",
        "backward embedding", "setup end",
    ]


def test_phase_order_plain():
    _, tl = measured(SMALL, "none")
    assert phase_sequence(tl) == [
        "setup", "forward embedding", *[f"forward layer {i}" for i in range(4)], "forward head",
        "backward head", *[f"backward layer {i}" for i in (3, 2, 1, 0)], "backward embedding", "setup end"]
    assert not any(p.kind == "recompute" for p in tl.phases)


@pytest.mark.parametrize("engine", ["reentrant", "non-reentrant"])
def test_phase_order_selective(engine):
    _, tl = measured(SMALL, f"selective/core_attn@{engine}")
    seq = phase_sequence(tl)
    for i in range(4):
        label = f"recompute layer {i} [core_attn in layers.{i}.self_attention.core_attention]"
        assert seq.count(label) == 1
        # recomputed inside the layer's backward, before the layer below starts its backward
        assert seq.index(f"backward layer {i}") < seq.index(label) < (
            seq.index(f"backward layer {i - 1}") if i else seq.index("backward embedding"))
    assert seq[-2:] == ["backward embedding", "setup end"]


# ------------------------------------------------------------------------ categories
def test_parameter_bytes_count_tied_storage_once():
    cfg = SMALL.replace(tie_embeddings=True)
    model, tl = measured(cfg, "full/uniform/2")
    params = storage_bytes(model.parameters())
    both = sum(p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False))
    assert params == both - SMALL.vocab_size * SMALL.hidden_size * 4  # the tied weight is one storage
    assert tl.breakdown(tl.num_events - 1)["parameters"] == params
    assert tl.breakdown(tl.num_events - 1)["gradients"] == params


@pytest.mark.parametrize("policy", SUM_POLICIES)
def test_group_inputs_only_with_checkpoints(policy):
    _, tl = measured(SMALL, policy)
    total = sum(b for b, c in zip(tl.nbytes, tl.category) if c == "group_inputs")
    has_checkpoints = not Policy.parse(policy).is_none
    assert (total > 0) == has_checkpoints
    assert (tl.breakdown(end_of_forward(tl))["group_inputs"] > 0) == has_checkpoints
    recompute = sum(b for b, c in zip(tl.nbytes, tl.category) if c == "recompute")
    assert (recompute > 0) == has_checkpoints


def test_parameters_constant_through_the_step():
    model, tl = measured(SMALL, "full/uniform/2")
    params = storage_bytes(model.parameters())
    first_forward = next(p.start for p in tl.phases if p.kind == "forward")
    for t in (first_forward, end_of_forward(tl), tl.peak_event, tl.num_events - 1):
        assert tl.breakdown(t)["parameters"] == params


def test_adam_state_in_breakdown():
    model = build_model(SMALL, seed=0)
    apply(model, "full/uniform/2")
    optimizer = torch.optim.Adam(model.parameters())
    torch.manual_seed(0)
    tl = measure(model, sample_batch(SMALL), optimizer=optimizer)
    params = storage_bytes(model.parameters())
    moments = storage_bytes(s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert moments == 2 * params  # fp32: two moments per parameter
    everything = storage_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    end = tl.breakdown(tl.num_events - 1)
    assert end["optimizer_state"] == everything  # the moments plus Adam's step counters
    assert 2 * params <= end["optimizer_state"] <= 2 * params + 8 * len(optimizer.state)
    assert end["parameters"] == params and end["gradients"] == params
    assert any(p.kind == "optimizer" for p in tl.phases)
    # a second step: the states existed before it and are still optimizer state
    tl2 = measure(model, sample_batch(SMALL), optimizer=optimizer)
    assert tl2.breakdown(end_of_forward(tl2))["optimizer_state"] == everything
    assert tl2.breakdown(tl2.num_events - 1)["optimizer_state"] == everything


# ------------------------------------------------------------------------ timeline JSON
def assert_same_timeline(a: Timeline, b: Timeline) -> None:
    for name in ("nbytes", "alloc_at", "free_at", "phase_index", "module", "category", "phases", "num_events"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.meta == b.meta
    assert a.peak_bytes == b.peak_bytes and a.peak_event == b.peak_event and a.at_peak == b.at_peak
    assert np.array_equal(a.live_bytes(), b.live_bytes())


def test_json_round_trip(tmp_path):
    _, tl = measured(SMALL, "full/uniform/2")
    path = tl.save(tmp_path / "sub" / "step.json")
    assert path == tmp_path / "sub" / "step.json"
    loaded = Timeline.load(path)
    assert_same_timeline(loaded, tl)
    assert all(isinstance(p, Phase) for p in loaded.phases)
    assert json.loads(path.read_text())["peak_bytes"] == tl.peak_bytes


@functools.cache
def saved_dict() -> str:
    return json.dumps(measured(SMALL, "full/uniform/2")[1].to_dict())


def corrupt(change) -> dict:
    data = json.loads(saved_dict())
    change(data)
    return data


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(format="something.else"), "format"),
    (lambda d: d.pop("format"), "format"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d["allocations"]["alloc_at"].pop(), "alloc_at"),
    (lambda d: d["allocations"]["category"].append(0), "category"),
    (lambda d: d["allocations"]["module"].pop(), "module"),
    (lambda d: d["categories"].__setitem__(d["allocations"]["category"][0], "bogus"), "category"),
    (lambda d: d["allocations"].pop("nbytes"), "nbytes"),
    (lambda d: d["allocations"]["phase"].__setitem__(0, 10_000), "phase"),
    (lambda d: d["allocations"]["free_at"].__setitem__(3, d["allocations"]["alloc_at"][3]), "free_at"),
    (lambda d: d["allocations"]["alloc_at"].__setitem__(0, d["num_events"]), "alloc_at"),
])
def test_malformed_timeline_names_the_field(change, field, tmp_path):
    data = corrupt(change)
    with pytest.raises(TimelineError, match=field):
        Timeline.from_dict(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TimelineError, match=field):
        Timeline.load(path)


@pytest.mark.parametrize("index", [99, -1])
def test_bad_category_index_names_the_field(index):
    data = corrupt(lambda d: d["allocations"]["category"].__setitem__(0, index))
    with pytest.raises(TimelineError, match="category"):
        Timeline.from_dict(data)


def test_not_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(TimelineError, match="JSON"):
        Timeline.load(path)
    with pytest.raises(TimelineError, match="format"):
        Timeline.from_dict([1, 2])


def test_save_is_atomic(tmp_path, monkeypatch):
    _, tl = measured(SMALL, "full/uniform/2")
    path = tmp_path / "step.json"
    tl.save(path)
    assert os.listdir(tmp_path) == ["step.json"]  # no temporary file left behind
    old = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    other = Timeline(nbytes=[8], alloc_at=[0], free_at=[-1], phase_index=[0], module=["x"], category=["other"],
                     phases=[Phase(0, "setup", "")], num_events=1)
    with pytest.raises(OSError, match="disk full"):
        other.save(path)
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["step.json"]
    monkeypatch.undo()
    other.save(path)
    assert_same_timeline(Timeline.load(path), other)


def test_cpu_sdpa_flops_count_as_the_math_attention_does():
    """torch.utils.flop_counter has no formula for CPU flash attention; remat counts it like the other attention
    kernels, so an sdpa model's forward, backward and core_attn recompute FLOPs equal the math model's."""
    def flops(attention: str, policy: str) -> dict[str, int]:
        cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                          vocab_size=128, attention=attention)
        model = build_model(cfg)
        apply(model, policy)
        tl = measure(model, sample_batch(cfg))
        per_phase = zip(tl.meta["phase_flops"], tl.phases)
        out: dict[str, int] = {}
        for f, phase in per_phase:
            out[phase.kind] = out.get(phase.kind, 0) + f
        return out

    sdpa, math_ = flops("sdpa", "selective/core_attn"), flops("math", "selective/core_attn")
    assert sdpa["forward"] == math_["forward"] > 0 and sdpa["backward"] == math_["backward"]
    assert sdpa["recompute"] == math_["recompute"] > 0


def test_operator_flops_count_as_torchs_shape_wrapped_formulas(monkeypatch):
    """remat.memory.measure.operator_flops calls torch's formulas on the shapes itself (no tree_map): every
    operator of a traced step (matmuls, attention forward and backward, fake and real, TP/SP with CUDA kernels) gets
    the count torch's wrapper gives, and so does an argument it leaves to torch (a torch.Size)."""
    import remat.memory.measure as measure_module
    from remat.memory.predict import predict_config

    seen = []

    def both(formula, args, kwargs, out):
        ours = measure_module_flops(formula, args, kwargs, out)
        seen.append((formula.__name__, ours, int(formula(*args, **kwargs, out_val=out))))
        return ours

    measure_module_flops = measure_module.operator_flops
    monkeypatch.setattr(measure_module, "operator_flops", both)
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=16,
                         vocab_size=64, attention="sdpa", activation="swiglu")
    predict_config(config, "selective/core_attn", tp=2, sp=True, device="cuda")
    measure(build_model(SMALL), sample_batch(SMALL))  # math attention
    cpu_sdpa = SMALL.replace(attention="sdpa")
    measure(build_model(cpu_sdpa), sample_batch(cpu_sdpa))
    assert {name for name, *_ in seen} == {"mm_flop", "addmm_flop", "bmm_flop", "sdpa_flop", "sdpa_backward_flop"}
    assert all(ours == theirs for _, ours, theirs in seen), [s for s in seen if s[1] != s[2]][:3]
    assert sum(ours for _, ours, _ in seen) > 0
    mm = torch.utils.flop_counter.flop_registry[torch.ops.aten.mm]
    a, b = torch.empty(3, 4), torch.empty(4, 5)
    assert measure_module_flops(mm, (a, b), {}, torch.empty(3, 5)) == mm(a, b, out_val=torch.empty(3, 5)) == 120
    assert measure_module_flops(mm, (a.shape, b), {}, None) == 120  # a torch.Size: torch's wrapper maps it
    raw = lambda x, out_val=None: x.numel() + (out_val is None)  # noqa: E731  (not shape-wrapped: called as is)
    assert measure_module_flops(raw, (a,), {}, None) == 13


# ------------------------------------------------------------------------ steps that cannot be measured
TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                   vocab_size=64)


def tiny_model() -> nn.Module:
    return build_model(TINY, seed=0)


def test_measure_refuses_a_model_without_parameters():
    with pytest.raises(MeasureError, match=r"^measure: Sequential has no parameters"):
        measure(nn.Sequential(nn.ReLU()), (torch.ones(2, 3),))
    with pytest.raises(MeasureError, match=r"^measure: model must be a torch.nn.Module, got int"):
        measure(42, (torch.ones(2, 3),))


def test_measure_refuses_gradients_disabled():
    model, batch = tiny_model(), sample_batch(TINY)
    with torch.no_grad(), pytest.raises(MeasureError, match=r"gradients are disabled .*call it outside that block"):
        measure(model, batch)
    with torch.inference_mode(), pytest.raises(MeasureError, match="gradients are disabled"):
        measure(model, batch)
    assert measure(model, batch).peak_bytes > 0  # outside, the same step runs


def test_measure_refuses_all_parameters_frozen():
    model = tiny_model().requires_grad_(False)
    with pytest.raises(MeasureError, match=r"every parameter of GPT has requires_grad=False .*requires_grad_\(True\)"):
        measure(model, sample_batch(TINY))
    model.layers[0].mlp.requires_grad_(True)  # fine-tuning part of a model is a training step
    tl = measure(model, sample_batch(TINY))
    mlp_bytes = sum(p.numel() * p.element_size() for p in model.layers[0].mlp.parameters())
    assert tl.breakdown(tl.num_events - 1)["gradients"] == mlp_bytes


def wrong_batches() -> list[tuple[str, object, str]]:
    tokens, labels = sample_batch(TINY)
    return [
        ("tensor", tokens, r"batch must be a tuple or list .* got Tensor"),
        ("one item", (tokens,), r"batch must be \(tokens, labels\).*got 1 item"),
        ("float ids", (tokens.float(), labels), r"batch tokens are torch.float32, not token ids"),
        ("3-d", (tokens[None], labels[None]), r"batch tokens have shape \[1, 2, 16\]"),
        ("shapes differ", (tokens[:, :8], labels), r"tokens \[2, 8\] and labels \[2, 16\] differ in shape"),
        ("too long", (torch.zeros(2, 17, dtype=torch.long),) * 2, r"sequence length 17 exceeds seq_length=16"),
        ("id too large", (tokens, labels + TINY.vocab_size), r"labels hold id \d+, outside the vocabulary \[0, 64\)"),
        ("negative id", (tokens - 100, labels), r"tokens hold id -\d+, outside the vocabulary"),
    ]


@pytest.mark.parametrize("name,batch,pattern", wrong_batches(), ids=[w[0] for w in wrong_batches()])
def test_measure_refuses_a_wrong_batch_before_running(name, batch, pattern):
    model = tiny_model()
    with pytest.raises(MeasureError, match=pattern) as err:
        measure(model, batch)
    assert str(err.value).startswith("measure: batch")
    assert all(p.grad is None for p in model.parameters())  # refused before anything ran


def test_measure_takes_a_shorter_sequence_and_a_keyword_batch():
    tokens, labels = sample_batch(TINY)
    short = measure(tiny_model(), (tokens[:, :8], labels[:, :8]))
    full = measure(tiny_model(), {"labels": labels, "tokens": tokens})
    assert 0 < short.peak_bytes < full.peak_bytes
