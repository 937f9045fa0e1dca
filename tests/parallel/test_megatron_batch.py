"""What Megatron's get_batch puts on the device for each forward step beyond the traces' token ids and labels (NOTE
[Megatron's batch on the device] in remat.parallel.pipeline_runtime): the dataloader's attention mask and the
position ids through the forward step, the loss mask to the micro-batch's backward, on the first and last stages."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_predict import predict_stage
from remat.policy import Policy
from remat.recompute.plan_format import Plan
from remat.timeline import Timeline
from remat.units import CUDA_BLOCK, round_up

B, S, MICROBATCHES = 2, 128, 4
CFG = ModelConfig(num_layers=6, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=S,
                  micro_batch_size=B, attention="sdpa")


def _rows(timeline: Timeline, name: str) -> list[tuple[int, int, int]]:
    t = timeline
    return [(t.nbytes[r], t.alloc_at[r], t.free_at[r]) for r in range(len(t.nbytes)) if t.module[r] == f"batch.{name}"]


def _timelines(job: Job, layout: Plan | None = None) -> list[Timeline]:
    return [predict_stage(job, stage, device="cuda", layout=layout).timeline for stage in range(job.pp)]


def test_first_and_last_stages_hold_the_mask_for_each_forward_and_the_loss_mask_to_its_backward():
    job = Job.build(CFG, precision="bf16", pp=3, num_microbatches=MICROBATCHES)
    timelines = _timelines(job)
    mask = round_up(B * S * S - S * S, CUDA_BLOCK)  # the dataloader's [b, 1, s, s] beyond the layers' [1, 1, s, s]
    for stage, names in ((0, {"attention_mask", "position_ids"}), (2, {"attention_mask", "loss_mask"})):
        for name in ("attention_mask", "position_ids", "loss_mask"):
            rows = _rows(timelines[stage], name)
            assert len(rows) == (MICROBATCHES if name in names else 0), (stage, name)
        assert [n for n, _, _ in _rows(timelines[stage], "attention_mask")] == [mask] * MICROBATCHES
    assert not any(_rows(timelines[1], name) for name in ("attention_mask", "position_ids", "loss_mask"))  # middle
    assert [n for n, _, _ in _rows(timelines[2], "loss_mask")] == [round_up(B * S * 4, CUDA_BLOCK)] * MICROBATCHES
    # the mask goes when its forward step returns, before any later forward's; the loss mask lives into a backward
    masks, losses = _rows(timelines[2], "attention_mask"), _rows(timelines[2], "loss_mask")
    assert all(free < next_alloc for (_, _, free), (_, next_alloc, _) in zip(masks, masks[1:]))
    starts = [p.start for p in timelines[2].phases if p.kind == "backward"]
    assert all(any(mask_free < start < loss_free for start in starts)
               for (_, _, mask_free), (_, _, loss_free) in zip(masks, losses))


def test_context_parallelism_cuts_the_mask_and_the_flag_drops_it():
    cp = Job.build(CFG, precision="bf16", pp=2, cp=2, num_microbatches=MICROBATCHES)
    half = S // 2  # the mask cut along its query dimension: [b, 1, s / cp, s], beside the layers' [1, 1, s/cp, s/cp]
    assert {n for n, _, _ in _rows(_timelines(cp)[1], "attention_mask")} == {
        round_up(B * half * S - half * half, CUDA_BLOCK)}
    plain = Job.from_megatron_args(Job.build(CFG, precision="bf16", pp=2, num_microbatches=MICROBATCHES)
                                   .to_megatron_args() + ["--no-create-attention-mask-in-dataloader"])
    assert not plain.create_attention_mask and Job.from_megatron_args(plain.to_megatron_args()) == plain
    last = _timelines(plain)[1]
    assert not _rows(last, "attention_mask") and len(_rows(last, "loss_mask")) == MICROBATCHES


def test_checkpointed_layers_keep_the_mask_to_the_backward_as_megatrons_checkpoints_do():
    # Megatron's CheckpointFunction saves every argument of a recompute group, the attention mask among them, and so
    # does checkpointed core attention: the dataloader's mask then lives to the micro-batch's backward, as the
    # layers' own [1, 1, s, s] mask does in the trace (freed by the bottom layer's backward); a plan's operator-level
    # checkpoint of a whole layer (keep_ops) takes the layer's inputs too, whatever operators it keeps
    own = round_up(S * S, CUDA_BLOCK)
    plain = Job.build(CFG, precision="bf16", pp=2, num_microbatches=MICROBATCHES)
    for policy, kept in (("full/uniform/2", True), ("full/block/1", True), ("selective/core_attn", True),
                         ("selective/non_matmul", True), ("selective/mlp", False), ("selective/act", False),
                         ("none", False), ("plan selective/keep_ops() 0-2", True),
                         ("plan keep 0-1, selective/keep_ops(0-9) 2", True), ("plan keep 0-2", False)):
        if policy.startswith("plan "):  # each stage's chunk of 3 layers under the plan
            job, layout = plain, Plan.parse(policy.removeprefix("plan "))
        else:
            job, layout = plain.replace(policy=Policy.parse(policy)), None
        for timeline in _timelines(job, layout):
            t = timeline
            masks = _rows(t, "attention_mask")
            layers = [t.free_at[r] for r in range(len(t.nbytes)) if t.nbytes[r] == own and t.module[r] == ""]
            assert len(masks) == len(layers) == MICROBATCHES, policy
            backwards = [p.start for p in t.phases if p.kind == "backward"]
            for (_, alloc, free), layers_free in zip(masks, layers):
                backward = min(start for start in backwards if start > alloc)  # this micro-batch's, in 1F1B
                # kept: both live into the backward, the dataloader's freed after the layers' own; else both end
                # with the forward step
                assert (free > backward) == kept and (layers_free > backward) == kept, policy
                assert free > layers_free or not kept, policy
