"""Fine-grained activation offloading in a pipelined job: every microbatch in flight offloads its own groups, so a
rank's device peak and its host bytes (the most held at once over the microbatches in flight) are predicted per
rank, and a real gloo run of the job holds the same bytes, device and host, to the byte."""

from __future__ import annotations

import pytest

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.chunk_trace import trace_chunk
from remat.parallel.job_measure import format_rows, measure_job, rank_rows
from remat.parallel.job_predict import predict_stage
from remat.parallel.schedule import offload_last_groups, schedule_actions
from remat.policy import Policy
from remat.timeline import Timeline

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=2, vocab_size=64, seq_length=16,
                    micro_batch_size=2, attention="sdpa", tie_embeddings=False)
OFFLOAD = Policy.parse("none,offload:attn_norm+core_attn+mlp_norm,offload_min:0")


def host_steps(tl: Timeline) -> list[tuple[str, int]]:
    """The host bytes held from each change on, with the phase it happens in (event numbers differ by the setup
    rows a real rank records one by one)."""
    return [(tl.phase_at(e).label, b) for e, b in tl.meta["host_memory"]["series"]]


def test_host_peak_adds_the_microbatches_in_flight():
    # pp=2, 1F1B, 3 microbatches: stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2. A forward keeps its last
    # layer's groups on the device only when it is the step's first backward's or its own backward runs next (NOTE
    # [which forwards keep their last offload group] in remat.parallel.schedule): every forward of stage 1, only
    # microbatch 0's of stage 0 (1 and 2 offload layer 1 too)
    job = Job.build(MODEL, precision="bf16", pp=2, num_microbatches=3, policy=OFFLOAD)
    hosts = [predict_stage(job, s, kernels="cpu").timeline.meta["host_memory"] for s in (0, 1)]
    one = hosts[1]["offloaded_bytes_by_layer"]["2"] // 3  # one layer's groups of one microbatch (alike layers)
    assert one > 0
    assert hosts[0]["offloaded_bytes_by_layer"] == {"0": 3 * one, "1": 2 * one}
    assert hosts[1]["offloaded_bytes_by_layer"] == {"2": 3 * one}
    # stage 1 holds one microbatch's layer 2. Stage 0: B0 kept layer 1's groups, so its last three start functions
    # find its reload stack empty and bring back microbatch 1's layer 1 (pre_reload_last_layer, NOTE [when offloaded
    # groups come back]): after F2 it holds microbatch 1's layer 0 and both layers of microbatch 2
    assert [h["peak_bytes"] for h in hosts] == [3 * one, one]
    assert hosts[0]["series"][-1][1] == hosts[1]["series"][-1][1] == 0  # every byte comes back


def test_pp2_offload_measured_equals_predicted_per_rank_device_and_host():
    job = Job.build(MODEL, precision="bf16", pp=2, num_microbatches=2, policy=OFFLOAD)
    measured = measure_job(job, timeout=90)
    rows = rank_rows(job, measured)
    assert [r["stage"] for r in rows] == [0, 1]
    for r, tl in zip(rows, measured):
        assert r["measured_parts"] == r["predicted_parts"], format_rows(rows)
        assert r["measured_bytes"] == r["predicted_bytes"], format_rows(rows)
        guess, real = r["predicted_host"], r["measured_host"]
        assert real["peak_bytes"] == guess["peak_bytes"] > 0, format_rows(rows)
        assert real["offloaded_bytes"] == guess["offloaded_bytes"]
        predicted = predict_stage(job, r["stage"], kernels="cpu").timeline
        assert host_steps(tl) == host_steps(predicted)


def test_which_forwards_offload_their_last_groups():
    """Megatron's rule (NOTE [which forwards keep their last offload group]), schedule by schedule."""
    everywhere = lambda chunk: frozenset({"core_attn", "attn_norm"})  # noqa: E731
    # no pipelining, and a last stage's 1F1B: every forward's own backward runs next, so every one keeps them
    for pp, rank in ((1, 0), (2, 1)):
        assert offload_last_groups(schedule_actions("1f1b", pp, 4, 1, rank, runtime="megatron"), everywhere) == {}
    # stage 0 of pp=2 (F0 F1 B0 F2 B1 B2): microbatch 0 is the first backward's; 1 and 2 offload them too
    got = offload_last_groups(schedule_actions("1f1b", 2, 3, 1, 0, runtime="megatron"), everywhere)
    assert got == {(0, 1): everywhere(0), (0, 2): everywhere(0)}
    # Megatron's H100 test ..._fine_grained_offloading: pp=2, vpp=4, 4 microbatches, layout Et*3|(tt|)*6L; the last
    # stage's chunks are 1, 3, 5 and 7, and 7 holds only the loss (no group). Only chunk 5's microbatch 0, the first
    # backward with groups, keeps its last layer's groups on the device: 11 of the 12 forwards with groups offload them
    actions = schedule_actions("interleaved", 2, 4, 4, 1, runtime="megatron")
    got = offload_last_groups(actions, lambda c: frozenset() if c == 7 else everywhere(c))
    assert sorted(got) == sorted((c, mb) for c in (1, 3, 5) for mb in range(4) if (c, mb) != (5, 0))
    # a module only some chunks have: its first backward is found among those chunks
    got = offload_last_groups(actions, lambda c: frozenset({"expert_fc1"} if c == 1 else ()))
    first = next((a.chunk, a.microbatch) for a in actions if a.kind == "B" and a.chunk == 1)
    assert (1, 0) == first and sorted(got) == [(1, 1), (1, 2), (1, 3)]


def test_a_backward_brings_back_the_next_backwards_groups_once_its_own_stack_is_empty():
    """Megatron's pre_reload_last_layer (NOTE [when offloaded groups come back]): stage 0 of pp=2 runs F0 F1 B0 F2 B1
    B2; F0 kept layer 1's groups, so B0's own stack (layer 0) empties halfway and its last start functions bring back
    microbatch 1's layer 1 before F2 runs: B0 ends with only microbatch 1's layer 0 on the host."""
    job = Job.build(MODEL, precision="bf16", pp=2, num_microbatches=3, policy=OFFLOAD)
    tl = predict_stage(job, 0, kernels="cpu").timeline
    host = tl.meta["host_memory"]
    one = host["offloaded_bytes_by_layer"]["0"] // 3  # one layer's groups of one microbatch
    in_b0 = [b for label, b in host_steps(tl) if label.startswith("backward") and "microbatch 0," in label]
    assert in_b0[-1] == one
    # the groups brought back early are on the device through F2: its peak is one layer's groups above F1's
    live = tl.live_bytes()
    peaks = {}
    for phase, start, end in tl.phase_spans():
        if phase.kind == "forward" and phase.detail.startswith("microbatch"):
            mb = phase.detail.split(",")[0]
            peaks[mb] = max(peaks.get(mb, 0), int(live[start:end].max()))
    assert peaks["microbatch 2"] > peaks["microbatch 1"]


MTP_ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--global-batch-size 8 --padded-vocab-size 128 --position-embedding-type rope --mtp-num-layers 1 "
            "--pipeline-model-parallel-size 2 --world-size 2 --pipeline-model-parallel-layout ")
MTP_OFFLOAD = (" --fine-grained-activation-offloading --offload-modules core_attn attn_norm "
               "--min-offloaded-tensor-size 0")


def test_mtp_layers_offload_their_groups_like_decoder_layers():
    """Megatron's MTP layer is a TransformerLayer whose offload groups go to its chunk's handler after the decoder
    layers' (multi_token_prediction.py:1361): on a last chunk 'tmL' the MTP layer holds the last group of each name
    (kept: the last stage's 1F1B runs each forward's own backward next), so the decoder layer before it is offloaded;
    a chunk of the MTP depth alone ('mL') offloads its groups when its forward offloads its last groups. Full
    recompute with MTP stays refused."""
    import shlex

    plain, offloaded = (predict_stage(Job.from_megatron_args(shlex.split(MTP_ARGS + "Et|tmL" + extra)), 1,
                                      kernels="cpu") for extra in ("", MTP_OFFLOAD))
    host = offloaded.timeline.meta["host_memory"]
    assert set(host["offloaded_bytes_by_layer"]) == {"1"} and host["series"][-1][1] == 0
    assert offloaded.peak_bytes < plain.peak_bytes
    job = Job.from_megatron_args(shlex.split(MTP_ARGS + "Ett|mL" + MTP_OFFLOAD))
    trace = trace_chunk(job.model, (False, True, 0), job.policy, offload_last=frozenset({"core_attn", "attn_norm"}))
    assert {module for _, delta, module, _ in trace.forward.host if delta > 0} == {"core_attn", "attn_norm"}
    assert sum(h[1] for h in trace.forward.host) == -sum(h[1] for h in trace.backward_first.host) > 0
    full = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    with pytest.raises(ValueError, match="--mtp-num-layers with full recompute"):
        Job.from_megatron_args(shlex.split(MTP_ARGS + "Et|tmL" + full))
