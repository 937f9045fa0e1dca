"""Fine-grained activation offloading in a pipelined job: every microbatch in flight offloads its own groups, so a
rank's device peak and its host bytes (the most held at once over the microbatches in flight) are predicted per
rank, and a real gloo run of the job holds the same bytes, device and host, to the byte."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.job import Job
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
    # stage 0 holds microbatches 1 and 2, both layers each, after F2; stage 1 one microbatch's layer 2
    assert [h["peak_bytes"] for h in hosts] == [4 * one, one]
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
