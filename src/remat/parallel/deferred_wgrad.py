"""Megatron's deferred output-layer weight gradients (``--defer-embedding-wgrad-compute``, ``--wgrad-deferral-limit N``)
on the last pipeline stage: what the deferral keeps, and until when.

NOTE [deferred embedding wgrad] (Megatron-LM d98e8a64)
* gpt_model.py:257-292: on the last stage the output layer (``tensor_parallel.ColumnParallelLinear``) gets two lists,
  ``embedding_activation_buffer`` and ``grad_output_buffer``.
* tensor_parallel/layers.py:1227-1232: each forward appends the layer's input (``input_parallel``: the final norm's
  output, the s/tp token shard under sequence parallelism) while the buffer holds fewer than N (0: no limit).
* layers.py:661-664: each backward appends its ``grad_output`` (the logits' gradient, [s, b, vocab/tp] in the input's
  dtype) while that buffer holds fewer than N, and then skips the weight-gradient GEMM (and its all-gather under
  sequence parallelism); later microbatches compute it at once, as without the flag.
* schedules.py:1092 (interleaved) / :2237 (1F1B) clear the activation buffer when the step starts;
  schedules.py:2082 / :2484 ``finish_embedding_wgrad_compute`` run the deferred GEMMs after the last backward and
  before ``finalize_model_grads``: utils.py:1282-1362 ``drain_embedding_wgrad_compute`` pops one (input,
  grad_output) pair at a time and drops both after its GEMM, which accumulates into ``main_grad`` (the fusion is
  required: model_parallel_config.py:550) and so allocates nothing. Under sequence parallelism the drain gathers
  each input into the global memory buffer's ``mpu_0`` / ``mpu_1`` (utils.py:1303, 1336), two [s, b, h] tensors
  kept for the whole run (:func:`remat.memory.workspaces.global_buffer_requests`).
So the first N microbatches of the step (all when N is 0) keep their output-layer input from their forward, and their
logits' gradient from their backward, to the end of the backward: what :func:`defer_output_layer_wgrad` does to a
composed stage timeline. The drain's frees are appended at the step's end, after the schedule function's last
references go (Megatron runs it just before they go; they are the last input and its gradient, none of the drained).
"""

from __future__ import annotations

from remat.parallel.pipeline_runtime import StagePlan
from remat.parallel.stages import parse_phase_detail
from remat.timeline import Phase, Timeline
from remat.units import round_up

PHASE_REGION = "output_layer wgrad (deferred)"


def deferred_microbatches(limit: int, microbatches: int) -> list[int]:
    """The microbatches whose output-layer weight gradient waits for the drain: the first ``limit`` (0: all).

    Example:
        >>> deferred_microbatches(2, 4), deferred_microbatches(0, 3)
        ([0, 1], [0, 1, 2])
    """
    return list(range(microbatches if limit == 0 else min(limit, microbatches)))


def logits_bytes(plan: StagePlan, tp: int) -> int:
    """One microbatch's logits on a tensor-parallel rank, [s, b, vocab/tp] in the model's dtype, in the plan's
    allocator blocks: the size of the output layer's ``grad_output``."""
    c = plan.config
    nbytes = c.micro_batch_size * c.seq_length * (c.vocab_size // tp) * c.torch_dtype.itemsize
    return round_up(nbytes, plan.block)


def defer_output_layer_wgrad(timeline: Timeline, plan: StagePlan, limit: int, tp: int) -> list[int]:
    """Keep the deferred microbatches' output-layer input and logits gradient in ``timeline`` (a composed stage of
    ``plan``, in place) until the drain appended at its end (NOTE [deferred embedding wgrad]); a stage without the
    output layer is left as it is. Returns the rows kept longer, input and gradient of each microbatch in turn.
    Raises ``ValueError`` when the chunk trace does not show either tensor where the output layer makes it."""
    last = next((s.index for s in plan.chunks if s.is_last), None)
    if last is None:
        return []
    wanted = {mb: i for i, mb in enumerate(deferred_microbatches(limit, plan.microbatches))}
    found: dict[tuple[int, str], int] = {}
    sizes = {"input": plan.activation_bytes, "grad_output": logits_bytes(plan, tp)}
    for row in range(len(timeline)):
        phase = timeline.phases[timeline.phase_index[row]]
        where = parse_phase_detail(phase.detail)
        if where is None or where[1] != last or where[0] not in wanted or phase.region != "head":
            continue
        if phase.kind == "forward" and timeline.module[row].endswith("final_layernorm") and \
                timeline.nbytes[row] == sizes["input"]:  # the norm's output: the output layer's input
            found.setdefault((where[0], "input"), row)
        elif phase.kind == "backward" and timeline.nbytes[row] == sizes["grad_output"]:
            found.setdefault((where[0], "grad_output"), row)  # the first logits-sized gradient of the backward
    rows = []
    for mb in wanted:
        for what in ("input", "grad_output"):
            if (mb, what) not in found:
                raise ValueError(f"internal: the output layer's {what} of microbatch {mb} ({sizes[what]} bytes) is "
                                 "not in the last chunk's trace; please report this job")
            rows.append(found[(mb, what)])
    timeline.phases.append(Phase(timeline.num_events, "backward", PHASE_REGION, ""))
    for row in rows:  # drain_embedding_wgrad_compute: pop(0) from both buffers, GEMM, drop both
        timeline.free_at[row] = timeline.num_events
        timeline.num_events += 1
    return rows
