"""The reference model's mixture-of-experts layer, shaped like Megatron-LM's ``MoELayer``: router, token dispatch,
experts (separate MLPs or one grouped weight), combine, and the optional shared expert."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.config import ConfigError, ModelConfig, RoutingAssumption
from remat.models.blocks import LossAutoScaler, QuickGeGLU, gated_activation
from remat.models.expert_parallel import SimulatedExpertGroup, expert_group_for, host_values, run_experts_parallel
from remat.models.permute import permute_copies, unpermute_copies


def expert_activation(config: ModelConfig) -> nn.Module:
    """The experts' activation function: SwiGLU, QuickGeGLU (NOTE [gpt-oss layers] in remat.models.blocks) or
    GeLU."""
    return gated_activation(config)


class RouterGatingLinear(torch.autograd.Function):
    """Megatron's ``RouterGatingLinearFunction`` (moe_utils.py:1357-1440) for ``--moe-router-dtype`` fp32/fp64:
    logits [T, E] in the router's dtype from the model-dtype input and weight, which are what it saves. Backward
    (TE's GEMM path) makes the input gradient in the router's dtype and casts it back, after the weight gradient,
    whose GEMM reads an upcast copy of the input (``inp.to(router_dtype)``): two [T, h] temporaries in that dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        out = x.new_empty(x.shape[0], weight.shape[0], dtype=dtype)
        if not isinstance(x, FakeTensor):  # te_general_gemm writes the router dtype directly
            out.copy_(F.linear(x, weight))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        grad_input = grad.mm(weight.to(ctx.dtype))
        grad_weight = grad.t().mm(x.to(ctx.dtype)).to(weight.dtype)
        return grad_input.to(x.dtype), grad_weight, None


# NOTE [routing under fake tensors]
# How many tokens each expert receives depends on the router's scores, which fake tensors do not have. So the
# router decides in two steps: the scores and the top-k choice are computed as usual, then the token counts and
# the permutation into expert order come either from the real choice (real tensors, no assumption) or from the
# routing assumption (config.moe_routing_assumption, or 'balanced' under fake tensors). Both ways end with the
# same operators on tensors of the same shapes (the permutation is made from a Python list in both), so a
# prediction with the counts a real run reported allocates what that run allocated, byte for byte. Under an
# assumption, expert e takes the next c_e token copies in token order (wrapping round when the counts add up to
# more than tokens x topk, as a capacity assumption does), with the probabilities the router gave those copies.
# NOTE [padding to capacity]
# --moe-pad-expert-input-to-capacity (with --moe-expert-capacity-factor F): the router's token dropping keeps, for
# each expert, the capacity = ceil(T x topk / E x F) tokens of highest probability, chosen or not, so every column
# of its routing map holds exactly that many (moe_utils.py:1050-1076 apply_router_token_dropping, pad_to_capacity:
# final_map = capacity_mask; router.py:793-800); the alltoall dispatcher then sends capacity tokens to every expert
# from every rank (token_dispatcher.py:517-539: num_out_tokens = capacity x E, capacity x tp x ep per local expert;
# :758-786 sorts them by local expert as fixed [tp x ep, local, capacity] blocks), and the allgather dispatcher
# gathers the same map (:290-330). So the permuted tokens and every expert's activations are sized by the
# capacity, whatever the scores: the counts are [capacity] x E, the routing assumption does not apply. The padding
# copies carry probability 0 in Megatron; here the wrapped copies keep the router's, which allocates the same.
class Router(nn.Module):
    """Scores each token against every expert and picks ``moe_router_topk`` of them (Megatron's TopKRouter)."""

    def __init__(self, config: ModelConfig, moe_index: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.capacity_factor = config.moe_expert_capacity_factor
        self.pad_to_capacity = config.moe_pad_expert_input_to_capacity  # NOTE [padding to capacity]
        self.alltoall = config.moe_token_dispatcher_type == "alltoall"
        self.aux_loss_coeff = config.moe_aux_loss_coeff
        self.moe_index = moe_index
        self.router_dtype = {None: None, "fp32": torch.float32, "fp64": torch.float64}[config.moe_router_dtype]
        self.pre_softmax, self.z_loss_coeff = config.moe_router_pre_softmax, config.moe_z_loss_coeff
        self.groups = (config.moe_router_num_groups, config.moe_router_group_topk) \
            if config.moe_router_group_topk else None
        # router.py:178-195, --moe-router-enable-expert-bias: two fp32 [E] buffers (no parameters)
        bias = config.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32) if bias else None)
        self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_moe_experts, dtype=torch.float32)
                             if bias else None, persistent=False)
        self.assumption = (RoutingAssumption.parse(config.moe_routing_assumption)
                           if config.moe_routing_assumption is not None else None)
        self.last_counts: list[int] = []
        self.last_source = ""

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Route ``tokens`` ([T, h]); return the probability of each routed copy ([T * topk]), the copies in
        expert order (indices into the T * topk copies) and the tokens each expert receives."""
        logits = (F.linear(tokens, self.weight) if self.router_dtype is None
                  else RouterGatingLinear.apply(tokens, self.weight, self.router_dtype))
        if self.z_loss_coeff is not None:  # router.py:626-650 apply_z_loss, before the scores
            logits = LossAutoScaler.apply(logits, self.z_loss(logits))
        probs, choice = self.top_k(logits)
        counts, order = self.dispatch_order(choice, logits.shape[1])
        if self.aux_loss_coeff > 0:
            probs = LossAutoScaler.apply(probs, self.aux_loss(logits, counts))
        self.last_counts = counts
        return probs.flatten(), host_values(order, torch.long, tokens), counts

    def top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chosen experts' probabilities, their indices), each [T, topk]: Megatron's unfused
        ``topk_routing_with_score_function`` (moe_utils.py:868-908; 11debfa7b4 :591-611), operator for operator, so
        that the same tensors are kept: ``topk`` keeps its indices alone, ``gather`` its whole source, the softmax
        and sigmoid their outputs."""
        if self.score_function == "softmax" and not self.pre_softmax:  # the default: softmax over the top-k logits
            scores, choice = self.choose(logits)
            return scores.softmax(dim=-1, dtype=torch.float32).type_as(logits), choice
        if self.score_function == "softmax":  # --moe-router-pre-softmax: fp32 softmax over every expert, saved
            return self.choose(logits.softmax(dim=-1, dtype=torch.float32).type_as(logits))
        scores = logits.float().sigmoid().type_as(logits)  # the fp32 sigmoid's output saved, cast back
        if self.expert_bias is not None:  # the biased scores choose, the plain ones weigh (moe_utils.py:896-899)
            routing = scores + self.expert_bias
            _, choice = self.choose(routing)  # both alive to the return, as Megatron's
            chosen = scores.gather(1, choice).type_as(logits)  # keeps the scores [T, E] for its backward
        else:
            chosen, choice = self.choose(scores)
        return chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20) if self.topk > 1 else chosen, choice

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k of ``scores`` [T, E] (Megatron's ``compute_topk``): ``torch.topk``, or with group-limited
        routing ``group_limited_topk`` (moe_utils.py, 11debfa7b4 :474-493): the top-k among the experts of the
        ``group_topk`` groups whose best ``topk // group_topk`` scores add up highest; the experts outside them
        masked to -inf by ``masked_fill``, which keeps its bool [T, E] mask for the backward."""
        if self.groups is None:
            return scores.topk(self.topk, dim=1)
        groups, chosen = self.groups
        tokens, experts = scores.shape
        group_scores = scores.view(tokens, groups, -1).topk(self.topk // chosen, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=chosen, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(tokens, groups, experts // groups).reshape(tokens, -1)
        masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
        return masked.topk(self.topk, dim=-1)  # its locals freed on return, as Megatron's

    def z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """Megatron's ``z_loss_func`` (moe_utils.py:153-182): mean(logsumexp(logits)^2) x coefficient."""
        return logits.logsumexp(dim=-1).square().mean() * float(self.z_loss_coeff or 0.0)

    def dispatch_order(self, choice: torch.Tensor, experts: int) -> tuple[list[int], Sequence[int]]:
        """(tokens per expert, the routed copies in expert order): real or assumed (NOTE [routing under fake
        tensors]). Under fake tensors the order is a ``range`` of its length, all that
        :func:`~remat.models.expert_parallel.host_values` reads of it there (a Python list of tokens x topk
        copies per MoE layer was most of the router's time in a prediction)."""
        copies = choice.numel()
        if self.pad_to_capacity:
            return self.padded_order(choice, experts)
        assumption = self.assumption
        if assumption is None and isinstance(choice, FakeTensor):
            assumption = RoutingAssumption()
        if assumption is not None:
            counts = assumption.tokens_per_expert(choice.shape[0], experts, self.topk, self.moe_index)
            self.last_source = str(assumption)
            if isinstance(choice, FakeTensor):
                return counts, range(sum(counts))
            return counts, [p % copies for p in range(sum(counts))]
        self.last_source = "measured"
        expert_of = choice.flatten().tolist()
        order = sorted(range(copies), key=expert_of.__getitem__)
        counts = [0] * experts
        for e in expert_of:
            counts[e] += 1
        if self.capacity_factor is not None:  # drop the copies beyond each expert's capacity, later tokens first
            capacity = math.ceil(copies / experts * self.capacity_factor)
            starts = [sum(counts[:e]) for e in range(experts)]
            order = [p for e in range(experts) for p in order[starts[e]:starts[e] + min(counts[e], capacity)]]
            counts = [min(c, capacity) for c in counts]
        return counts, order

    def padded_order(self, choice: torch.Tensor, experts: int) -> tuple[list[int], Sequence[int]]:
        """(tokens per expert, the copies in expert order) under ``--moe-pad-expert-input-to-capacity`` (NOTE
        [padding to capacity]): every expert takes its capacity, whatever the scores or the routing assumption."""
        tokens, copies = choice.shape[0], choice.numel()
        capacity = math.ceil(copies / experts * float(self.capacity_factor or 0))  # moe_utils.py:248 get_capacity
        if capacity > tokens:
            if self.alltoall:
                factor = f"{self.capacity_factor:g}"
                raise ConfigError(f"--moe-pad-expert-input-to-capacity with --moe-expert-capacity-factor {factor}: "
                                  f"each expert's capacity, {capacity} = ceil({tokens} tokens x topk {self.topk} / "
                                  f"{experts} experts x {factor}), exceeds the {tokens} tokens a rank routes, which "
                                  "Megatron's drop-and-pad permute cannot fill (moe_utils.py:439-459 views the "
                                  "probabilities as [experts, capacity]): lower --moe-expert-capacity-factor")
            capacity = tokens  # moe_utils.py:1058-1060: no token dropped, every token in every expert's column
        counts = [capacity] * experts
        self.last_source = f"padded to capacity {capacity} per expert (--moe-pad-expert-input-to-capacity)"
        if isinstance(choice, FakeTensor):
            return counts, range(sum(counts))
        return counts, [p % copies for p in range(sum(counts))]

    def aux_loss(self, logits: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Megatron's switch load-balancing loss: experts x sum_e(mean score_e x tokens_e) x coeff / (T x topk)."""
        tokens, experts = logits.shape
        scores = logits.softmax(dim=-1) if self.score_function == "softmax" else logits.sigmoid()
        per_expert = host_values(counts, scores.dtype, scores)
        scale = experts * self.aux_loss_coeff / (tokens * tokens * self.topk)
        return (scores.sum(dim=0) * per_expert).sum() * scale


class ActivationWithProbs(nn.Module):
    """The experts' activation, scaled by each routed copy's probability (Megatron's
    ``activation_func_with_probs``): what ``moe_act`` recomputes."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.activation = expert_activation(config)

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if isinstance(self.activation, QuickGeGLU) and self.activation.fused:  # experts.py:973 (fused kernel)
            return self.activation.weighted(x, probs)
        act = self.activation(x)
        # Megatron's bias_act_func (experts.py): the product is cast back, so fp32 router probs (--moe-router-dtype)
        # make an fp32 [copies, ffn] temporary, not fp32 activations
        return (act * probs.unsqueeze(-1)).to(act.dtype)


class ExpertMLP(nn.Module):
    """One expert of the separate-MLP form (Megatron's SequentialMLP member)."""

    def __init__(self, config: ModelConfig, ffn_size: int):
        super().__init__()
        gated = config.gated
        self.linear_fc1 = nn.Linear(config.hidden_size, ffn_size * (2 if gated else 1), bias=config.add_bias_linear)
        self.activation = ActivationWithProbs(config)
        self.linear_fc2 = nn.Linear(ffn_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x), probs))


class SequentialMLP(nn.Module):
    """The experts as separate MLPs, each run on its slice of the permuted tokens; ``num_experts`` of them (default
    all, ``num_moe_experts / ep`` on an expert-parallel rank)."""

    def __init__(self, config: ModelConfig, num_experts: int | None = None):
        super().__init__()
        self.local_experts = nn.ModuleList(ExpertMLP(config, config.moe_ffn_size)
                                           for _ in range(num_experts or config.num_moe_experts))

    def forward(self, permuted: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        outputs = [expert(x, p) for expert, x, p in zip(self.local_experts, permuted.split(counts),
                                                         probs.split(counts))]
        return torch.cat(outputs)


class GroupedMatmul(torch.autograd.Function):
    """``x @ weight[e]`` for each expert's consecutive rows of ``x``, as one grouped GEMM (Megatron's ``gmm``):
    the output and each gradient are one tensor, and only ``x`` and ``weight`` are saved. Equal counts run as one
    ``bmm``; unequal ones expert by expert into slices of the same tensors, which allocates the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        return grouped_mm(x, weight, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        counts = ctx.counts
        grad_x = grouped_mm(grad, weight.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            experts = len(counts)
            if len(set(counts)) == 1:
                grad_weight = torch.bmm(x.view(experts, counts[0], -1).transpose(1, 2),
                                        grad.view(experts, counts[0], -1))
            else:
                grad_weight = weight.new_empty(weight.shape)
                for e, (rows, g) in enumerate(zip(x.split(counts), grad.split(counts))):
                    torch.mm(rows.t(), g, out=grad_weight[e])
        return grad_x, grad_weight, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[sum(counts), in] x [experts, in, out] -> [sum(counts), out]: rows of expert e times ``weight[e]``."""
    experts = len(counts)
    if len(set(counts)) == 1:
        return torch.bmm(x.view(experts, counts[0], -1), weight).view(x.shape[0], -1)
    out = x.new_empty(x.shape[0], weight.shape[-1])
    for e, (rows, dest) in enumerate(zip(x.split(counts), out.split(counts))):
        torch.mm(rows, weight[e], out=dest)
    return out


class GroupedLinear(nn.Module):
    """``num_experts`` weights in one parameter [experts, in, out]; expert e multiplies its rows."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return GroupedMatmul.apply(x, self.weight, counts)


class GroupedMLP(nn.Module):
    """The experts as grouped weights (Megatron's GroupedMLP, ``moe_grouped_gemm``): fc1 -> activation with
    probabilities -> fc2, each one tensor for all experts' tokens; ``num_experts`` of them as for
    :class:`SequentialMLP`."""

    def __init__(self, config: ModelConfig, num_experts: int | None = None):
        super().__init__()
        gated = config.gated
        experts, h, f = num_experts or config.num_moe_experts, config.hidden_size, config.moe_ffn_size
        self.linear_fc1 = GroupedLinear(experts, h, f * (2 if gated else 1))
        self.activation = ActivationWithProbs(config)
        self.linear_fc2 = GroupedLinear(experts, f, h)

    def forward(self, permuted: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        intermediate = self.activation(self.linear_fc1(permuted, counts), probs)
        return self.linear_fc2(intermediate, counts)


class SharedExpertMLP(nn.Module):
    """The shared expert: a dense MLP every token goes through (``moe_shared_expert_intermediate_size``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        size = int(config.moe_shared_expert_intermediate_size or 0)
        gated = config.gated
        self.linear_fc1 = nn.Linear(config.hidden_size, size * (2 if gated else 1), bias=config.add_bias_linear)
        self.activation = expert_activation(config)
        self.linear_fc2 = nn.Linear(size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class MoELayer(nn.Module):
    """Router -> dispatch (the routed copies permuted into expert order) -> experts -> combine (weighted copies
    added back to their tokens) [+ shared expert]; a layer's ``mlp`` where ``moe_layer_freq`` says so.

    With ``expert_model_parallel_size`` ep > 1 the layer holds ``num_moe_experts / ep`` experts and the permuted
    copies go through Megatron's all-to-all dispatcher to the ranks holding their experts and back
    (:func:`remat.models.expert_parallel.run_experts_parallel`), over the group of
    :func:`remat.models.expert_parallel.expert_group_for`; router and shared expert are replicated."""

    def __init__(self, config: ModelConfig, moe_index: int):
        super().__init__()
        self.topk = config.moe_router_topk
        self.set_permutation(config)
        self.ep_group = expert_group_for(config)
        local = config.num_moe_experts // config.expert_model_parallel_size
        self.router = Router(config, moe_index)
        self.experts = GroupedMLP(config, local) if config.moe_grouped_gemm else SequentialMLP(config, local)
        self.shared_experts = (SharedExpertMLP(config) if config.moe_shared_expert_intermediate_size is not None
                               else None)
        self.last_received: list[int] = []
        self.allgather = None  # Megatron's allgather dispatcher over ep ranks (remat.models.allgather_dispatch)
        if config.moe_token_dispatcher_type == "allgather" and self.ep_group is not None:
            from remat.models.allgather_dispatch import tp_ep_group  # imports this module's neighbours
            if not isinstance(self.ep_group, SimulatedExpertGroup):
                tp_ep_group(self.ep_group, 1, 0)  # refuses a real group, naming the dispatcher
            self.allgather = tp_ep_group(None, self.ep_group.size, self.ep_group.rank)
        self.flex: tuple[str, int, int] | None = None  # the flex dispatcher: (backend, G, rank), flex_group
        if config.moe_token_dispatcher_type == "flex":
            from remat.models.flex_dispatch import flex_group
            self.flex = flex_group(config, self.ep_group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        probs, order, counts = self.router(tokens)
        if self.allgather is not None or self.flex is not None:
            from remat.models.allgather_dispatch import run_experts_allgather
            from remat.models.deepep_dispatch import run_experts_flex
            output, self.last_received = (
                run_experts_flex(self.experts, tokens, probs, counts, self.topk, *self.flex, **self.flex_options)
                if self.flex else
                run_experts_allgather(self.experts, self.allgather, tokens, probs, counts, self.topk,
                                      self.allgather.rank, len(counts) // self.allgather.size,
                                      keeps_source=self.combine_keeps_source))
            if self.shared_experts is not None:
                output = output + self.shared_experts(tokens)
            return output.view(shape)
        permuted, permuted_probs, mapping = self.permute(tokens, probs, order)        # dispatch
        del order
        if self.ep_group is None:
            expert_output = self.experts(permuted, counts, permuted_probs)
        else:  # dispatch to the ranks holding the experts and back (NOTE [the all-to-all dispatcher])
            expert_output, self.last_received = run_experts_parallel(
                self.experts, self.ep_group, permuted, permuted_probs, counts, fused=self.permute_fused)
        del permuted, permuted_probs
        output = unpermute_copies(expert_output, mapping, tokens.shape[0],         # combine
                                  keeps_source=self.combine_keeps_source)
        if self.shared_experts is not None:
            output = output + self.shared_experts(tokens)
        return output.view(shape)

    def set_permutation(self, config: ModelConfig) -> None:
        """How the all-to-all dispatcher permutes this layer's copies (NOTE [the permutation maps] in
        :mod:`remat.models.permute`): fused (``--moe-permute-fusion``), else by an argsort of the routing map unless
        the experts are padded to capacity; the allgather dispatcher at ep = 1 keeps the copies' indices alone. The
        flex dispatcher's DeepEP backend reads the same flags (``flex_options``). Under deterministic algorithms
        the unfused combine keeps the experts' outputs (NOTE [the combine's saved source])."""
        self.num_experts = config.num_moe_experts
        alltoall = config.moe_token_dispatcher_type == "alltoall"
        self.permute_fused = alltoall and config.moe_permute_fusion
        self.permute_argsort = alltoall and not config.moe_pad_expert_input_to_capacity
        # the unfused unpermute under deterministic algorithms keeps the experts' outputs (NOTE [the combine's saved
        # source]); the allgather dispatcher's is always unfused, DeepEP's fused with --moe-permute-fusion
        self.combine_keeps_source = config.deterministic_algorithms and not self.permute_fused
        self.flex_options = {"permute_fusion": config.moe_permute_fusion, "experimental": config.enable_experimental,
                             "keeps_source": config.deterministic_algorithms and not config.moe_permute_fusion}

    def permute(self, tokens: torch.Tensor, probs: torch.Tensor,
                order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routed copies in expert order, their probabilities and the map the combine takes."""
        return permute_copies(tokens, probs, order, self.topk, self.num_experts, argsort=self.permute_argsort,
                              fused=self.permute_fused)

    def routing_report(self) -> dict[str, Any]:
        """Where the last forward's token counts came from (an assumption, or 'measured') and the counts this rank
        routed to every expert; with expert parallelism also the copies its local experts received."""
        report: dict[str, Any] = {"source": self.router.last_source,
                                  "tokens_per_expert": list(self.router.last_counts)}
        if self.ep_group is not None:
            report["received_per_local_expert"] = list(self.last_received)
        return report
