"""Fine-grained activation offloading in a pipelined job: every microbatch in flight offloads its own groups, so a
rank's device peak and its host bytes (the most held at once over the microbatches in flight) are predicted per
rank, and a real gloo run of the job holds the same bytes, device and host, to the byte."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_measure import format_rows, measure_job, rank_rows
from remat.parallel.job_predict import predict_stage
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
    # pp=2, 1F1B: stage 0 holds 2 microbatches in flight at its peak, stage 1 one; each offloads the same bytes
    job = Job.build(MODEL, precision="bf16", pp=2, num_microbatches=3, policy=OFFLOAD)
    hosts = [predict_stage(job, s, kernels="cpu").timeline.meta["host_memory"] for s in (0, 1)]
    per_microbatch = [sum(h["offloaded_bytes"].values()) // 3 for h in hosts]
    assert per_microbatch[0] == per_microbatch[1] > 0
    assert [h["peak_bytes"] for h in hosts] == [2 * per_microbatch[0], per_microbatch[1]]
    # the last layer of each stage keeps its groups on the device (remat.recompute.activation_offload's NOTE)
    assert [list(h["offloaded_bytes_by_layer"]) for h in hosts] == [["0"], ["2"]]
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
