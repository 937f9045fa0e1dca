"""The reference MoE layer on one tensor-parallel rank: Megatron-LM's ``MoELayer`` under tensor and sequence
parallelism, with expert tensor parallelism (``--expert-tensor-parallel-size``) and expert parallelism.

Facts from megatron-core 0.16 (transformer/moe/moe_layer.py, token_dispatcher.py, experts.py, shared_experts.py):

* Training an MoE layer with tensor parallelism needs sequence parallelism: ``MoELayer.forward`` raises
  ``ValueError`` when ``attn_tp_group.size() > 1 and not config.sequence_parallel`` (refused here, in
  :func:`check_tp_moe`, naming ``--sequence-parallel``). So the layer's input is this rank's token shard
  [b*s/tp, h].
* The router is replicated over tp (its weight's gradient is a partial sum over the rank's tokens, all-reduced
  over tp by Megatron as a sequence-parallel parameter); it routes the rank's own tokens.
* The all-to-all dispatcher (``MoEAlltoAllTokenDispatcher``) works over the expert-parallel group (ep ranks) and
  the expert tensor-parallel group (etp ranks; default etp = tp): the routed copies, permuted into expert order,
  go all-to-all to the ep ranks holding their experts (skipped when ep = 1: ``_AllToAll`` returns its input),
  then are all-gathered over etp with the split sizes every rank announced (``gather_from_sequence_parallel_
  region(..., output_split_sizes=output_splits_tp)``), sorted from [tp][ep][local expert] to [local expert][tp]
  [ep] chunks, run through the local experts, sorted back, reduce-scattered over etp (``reduce_scatter_to_
  sequence_parallel_region(..., input_split_sizes=output_splits_tp)``: the experts' fc2 is row-parallel, so
  its outputs are partial sums) and sent back all-to-all. The counts are exchanged once over the tp x ep group
  (ep-major: rank e*etp + t), a tensor of ``num_moe_experts`` longs gathered into etp*ep of them.
* Each expert's fc1 is split etp ways by output (column-parallel; gated: the gate and the up halves each), fc2
  by input (row-parallel); with etp > 1 Megatron refuses biases ("Bias in Moe is only supported when ETP==1").
* The shared expert is a tensor-parallel MLP over the attention tp group (sequence-parallel: gathered input,
  reduce-scattered output).

remat keeps its reference MoE layer's order (shared expert after the combine, as
:class:`remat.models.moe.MoELayer`), so a tp=1 model and its tensor-parallel rank run the same steps. The groups:
ep from :func:`remat.models.expert_parallel.expert_group_for` (as the tp=1 layer), etp and the tp x ep counts group
from :func:`remat.models.expert_parallel.expert_tensor_parallel_group` (default: the layer's tp group, and a
simulated counts group when the groups are simulated; a real run passes both, see
:mod:`remat.parallel.job_measure`). A simulated rank assumes every rank routes as it does, so the etp gather and
reduce-scatter have equal splits there; real runs with unequal splits use the groups' ``all_gather_v`` and
``reduce_scatter_v``. The aux loss (``moe_aux_loss_coeff``) uses this rank's token counts (Megatron all-reduces
them over tp x cp first: a value difference, not a memory one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from remat.config import ConfigError, ModelConfig
from remat.models.allgather_dispatch import run_experts_allgather, tp_ep_group
from remat.models.deepep_dispatch import run_experts_flex
from remat.models.expert_parallel import (
    AllToAll,
    ExpertParallelGroup,
    SimulatedExpertGroup,
    expert_group_for,
    expert_parallel_group,
    expert_tensor_group,
    expert_tensor_parallel_group,
    sort_by_chunks,
)
from remat.models.flex_dispatch import flex_group
from remat.models.moe import GroupedMLP, MoELayer, Router, SequentialMLP
from remat.models.permute import unpermute_copies
from remat.models.tp_layers import (
    TPMLP,
    GatherFromSequence,
    ReduceScatterToSequenceV,
    SimulatedGroup,
    TensorParallelGroup,
)


@contextlib.contextmanager
def simulated_expert_groups(tp: int, ep: int, etp: int | None = None, ep_rank: int = 0) -> Iterator[None]:
    """Models built inside this block are expert-parallel rank ``ep_rank`` of a simulated group of ``ep`` (when
    ep > 1 and ep_rank > 0: rank 0 is the default) and split their experts over a simulated expert tensor-parallel
    group of ``etp`` (when it is not tp, the default)."""
    with contextlib.ExitStack() as stack:
        if ep > 1 and ep_rank:
            stack.enter_context(expert_parallel_group(SimulatedExpertGroup(ep, ep_rank)))
        if etp is not None and etp != tp:
            stack.enter_context(expert_tensor_parallel_group(SimulatedGroup(etp)))
        yield


def check_tp_moe(config: ModelConfig, tp: int, sp: bool, etp: int | None = None) -> None:
    """Refuse what Megatron refuses for MoE layers under tensor parallelism, naming the flag and the fix.

    Args:
        config: an MoE model.
        tp: the attention tensor-parallel size.
        sp: sequence parallelism.
        etp: the experts' tensor-parallel size (None: tp).
    """
    etp = tp if etp is None else etp
    if tp > 1 and not sp:
        raise ConfigError(f"tp={tp} with MoE layers (num_moe_experts={config.num_moe_experts}) needs sequence "
                          "parallelism: Megatron's MoELayer raises 'During training, performance may degrade if MoE "
                          "and tensor parallelism are enabled without also enabling sequence parallelism'; add "
                          "--sequence-parallel (sp=True), or use tp=1")
    if config.moe_ffn_size % etp:
        raise ConfigError(f"moe_ffn_hidden_size={config.moe_ffn_size} is not divisible by the expert tensor-parallel "
                          f"size etp={etp} (--expert-tensor-parallel-size, default tp): pick an etp that divides it")
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ConfigError(f"moe_shared_expert_intermediate_size={shared} is not divisible by tp={tp}: the shared "
                          "expert is a tensor-parallel MLP; pick a tp that divides it")
    if etp > 1 and config.add_bias_linear:
        raise ConfigError(f"add_bias_linear with MoE layers and expert tensor-parallel size etp={etp}: Megatron "
                          "asserts 'Bias in Moe is only supported when ETP==1'; add --disable-bias-linear, or set "
                          "--expert-tensor-parallel-size 1")


class TPMoELayer(MoELayer):
    """One tensor-parallel rank's MoE layer (same submodule names as :class:`MoELayer`, so recompute modules
    ``moe``, ``moe_act``, ``shared_experts`` and the offload modules find their parts): the router on this rank's
    tokens, the local experts split over etp, and the shared expert as a :class:`TPMLP`."""

    def __init__(self, config: ModelConfig, moe_index: int, group: TensorParallelGroup, sp: bool):
        nn.Module.__init__(self)  # not MoELayer.__init__: the experts are this rank's shards
        etp, counts = expert_tensor_group() or (group, None)
        check_tp_moe(config, group.size, sp, etp.size)
        self.topk = config.moe_router_topk
        self.set_permutation(config)
        self.ep_group = expert_group_for(config)
        ep = config.expert_model_parallel_size
        if counts is None and etp.size * ep > 1:
            if not isinstance(etp, SimulatedGroup) or not (
                    self.ep_group is None or isinstance(self.ep_group, SimulatedExpertGroup)):
                raise ConfigError("a tensor-parallel MoE layer over real groups needs its tp x ep group for the "
                                  "token counts: build it inside expert_tensor_parallel_group(etp, counts)")
            ep_rank = 0 if self.ep_group is None else self.ep_group.rank
            counts = SimulatedExpertGroup(etp.size * ep, ep_rank * etp.size + etp.rank)
        if counts is not None and counts.size != etp.size * ep:
            raise ConfigError(f"the tp x ep group has {counts.size} ranks; etp x ep = {etp.size} x {ep}")
        self.etp_group, self.counts_group = etp, counts
        local = config.num_moe_experts // ep
        shard = config.replace(moe_ffn_hidden_size=config.moe_ffn_size // etp.size)
        self.router = Router(config, moe_index)
        self.experts = GroupedMLP(shard, local) if config.moe_grouped_gemm else SequentialMLP(shard, local)
        self.shared_experts = (TPMLP(config, group, sp, config.moe_shared_expert_intermediate_size)
                               if config.moe_shared_expert_intermediate_size is not None else None)
        self.last_received: list[int] = []
        self.allgather = None  # Megatron's allgather dispatcher over the etp x ep ranks (ep-major, as counts)
        if config.moe_token_dispatcher_type == "allgather" and counts is not None:
            self.allgather = tp_ep_group(None if isinstance(etp, SimulatedGroup) else etp, counts.size, counts.rank)
        self.flex = flex_group(config, self.ep_group, etp.size) if config.moe_token_dispatcher_type == "flex" else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])  # this rank's token shard under sequence parallelism
        probs, order, counts = self.router(tokens)
        if self.flex is not None:  # the tp x ep group is the ep ranks (etp = 1: flex_group)
            output, self.last_received = run_experts_flex(self.experts, tokens, probs, counts, self.topk, *self.flex,
                                                          **self.flex_options)
            if self.shared_experts is not None:
                output = output + self.shared_experts(tokens)
            return output.view(shape)
        if self.allgather is not None:
            ep_rank = 0 if self.ep_group is None else self.ep_group.rank
            output, self.last_received = run_experts_allgather(
                self.experts, self.allgather, tokens, probs, counts, self.topk, ep_rank,
                len(counts) // (self.allgather.size // self.etp_group.size), keeps_source=self.combine_keeps_source)
            if self.shared_experts is not None:
                output = output + self.shared_experts(tokens)
            return output.view(shape)
        permuted, permuted_probs, mapping = self.permute(tokens, probs, order)        # dispatch
        del order
        if self.counts_group is None:  # etp = ep = 1: the experts are all here, whole
            expert_output = self.experts(permuted, counts, permuted_probs)
        else:
            expert_output, self.last_received = run_experts_tensor_parallel(
                self.experts, self.ep_group, self.etp_group, self.counts_group, permuted, permuted_probs, counts,
                fused=self.permute_fused)
        del permuted, permuted_probs
        output = unpermute_copies(expert_output, mapping, tokens.shape[0],         # combine
                                  keeps_source=self.combine_keeps_source)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens)
        return output.view(shape)

    def routing_report(self) -> dict[str, object]:
        report = super().routing_report()
        if self.counts_group is not None:
            report["received_per_local_expert"] = list(self.last_received)
        return report


def run_experts_tensor_parallel(experts: nn.Module, ep_group: ExpertParallelGroup | None,
                                etp_group: TensorParallelGroup, counts_group: ExpertParallelGroup,
                                permuted: torch.Tensor, permuted_probs: torch.Tensor,
                                counts: list[int], *, fused: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Megatron's all-to-all dispatcher with expert tensor parallelism (module docstring): dispatch this rank's
    routed copies (``permuted``, in expert order, ``counts[e]`` for expert e of all ``num_moe_experts``), run the
    local expert shards on every copy the tp x ep ranks send them (sorted by TE's fused kernels with ``fused``:
    ``--moe-permute-fusion``), and bring the summed outputs back in
    ``permuted``'s order.

    Returns:
        The outputs, one row per row of ``permuted``, and the copies each local expert received.
    """
    ep = 1 if ep_group is None else ep_group.size
    ep_rank = 0 if ep_group is None else ep_group.rank
    etp, tp_rank = etp_group.size, etp_group.rank
    local = len(counts) // ep
    input_splits = [sum(counts[d * local:(d + 1) * local]) for d in range(ep)]
    every = counts_group.exchange_counts(counts, permuted)  # [e * etp + t][expert]
    # [tp rank][ep rank][local expert]: what each rank of the tp x ep group sends this rank's experts
    mine = [[every[e * etp + t][ep_rank * local:(ep_rank + 1) * local] for e in range(ep)] for t in range(etp)]
    output_splits = [sum(mine[tp_rank][e]) for e in range(ep)]  # from the ep ranks of this tp rank
    splits_tp = [sum(sum(row) for row in mine[t]) for t in range(etp)]  # what each etp rank received
    tokens, probs, probs_dtype = permuted, permuted_probs, permuted_probs.dtype
    if ep > 1:
        tokens = AllToAll.apply(permuted, ep_group, output_splits, input_splits)
        probs = AllToAll.apply(permuted_probs, ep_group, output_splits, input_splits)
    del permuted, permuted_probs  # Megatron rebinds its variables to what arrived
    if etp > 1:
        tokens = GatherFromSequence.apply(tokens, etp_group, splits_tp)
        probs = GatherFromSequence.apply(probs, etp_group, splits_tp)
    sources = etp * ep
    by_source = [c for t in range(etp) for e in range(ep) for c in mine[t][e]]  # chunk s * local + l
    received = [sum(by_source[s * local + lx] for s in range(sources)) for lx in range(local)]
    if local > 1:  # [source][local expert] -> [local expert][source]
        to_experts = [s * local + lx for lx in range(local) for s in range(sources)]
        tokens, probs = sort_by_chunks(tokens, probs, by_source, to_experts, fused)
    output = experts(tokens, received, probs)
    del tokens, probs
    if local > 1:  # back to [source][local expert]
        by_expert = [by_source[s * local + lx] for lx in range(local) for s in range(sources)]
        to_sources = [lx * sources + s for s in range(sources) for lx in range(local)]
        output = sort_by_chunks(output, None, by_expert, to_sources, fused)[0]
    if etp > 1:  # the fc2 shards' partial sums, summed; each etp rank keeps what it received
        # token_dispatcher.py:829-833 (combine_preprocess): summed in the probabilities' dtype, so an fp32 router
        # (--moe-router-dtype) makes an fp32 copy, the fp32 reduce-scatter output (and fp32 gathered gradients)
        output = ReduceScatterToSequenceV.apply(output.to(probs_dtype), etp_group, splits_tp).to(output.dtype)
    if ep > 1:
        output = AllToAll.apply(output, ep_group, input_splits, output_splits)
    return output, received
