"""What :class:`remat.config.ModelConfig`'s MoE fields are read with: how tokens are routed to the experts
(:class:`RoutingAssumption`) and Megatron's ``--moe-layer-freq`` (:func:`parse_layer_freq`); and the config's error
type, which :mod:`remat.config` re-exports."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from remat.limits import shorten
from remat.units import ascii_float, ascii_int


class ConfigError(ValueError):
    """A model configuration that cannot be built; the message names the field and the fix."""


ROUTING_KINDS = ("balanced", "capacity", "counts")
_ROUTING_FORMS = "'balanced', 'capacity:1.25' or 'counts:6,2,4,4' (';' between MoE layers)"


@dataclass(frozen=True)
class RoutingAssumption:
    """How the tokens of a micro-batch are routed to the experts, which sets how many routed tokens each expert
    holds (the routed-token memory).

    ``balanced``: the ``tokens x topk`` assignments spread evenly (the first experts take one more when it does
    not divide); ``capacity``: every expert receives its capacity ``ceil(tokens x topk / experts x factor)``, the
    worst case ``moe_expert_capacity_factor`` allows; ``counts``: tokens per expert, given for every MoE layer
    (one tuple) or for each MoE layer in order.

    Example::

        >>> RoutingAssumption.parse("capacity:1.5").tokens_per_expert(16, 4, 2, layer=0)
        [12, 12, 12, 12]
    """

    kind: str = "balanced"
    capacity_factor: float | None = None
    counts: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROUTING_KINDS:
            raise ConfigError(f"RoutingAssumption kind={self.kind!r}: use one of {', '.join(ROUTING_KINDS)}")
        factor = self.capacity_factor
        if self.kind == "capacity" and (factor is None or not 0 < factor < float("inf")):
            raise ConfigError("routing 'capacity' needs a capacity_factor > 0 (e.g. 'capacity:1.25')")
        if self.kind == "counts" and (not self.counts or any(not layer or min(layer) < 0 for layer in self.counts)):
            raise ConfigError("routing 'counts' needs one count >= 0 per expert (e.g. 'counts:6,2,4,4')")

    @classmethod
    def parse(cls, text: str) -> RoutingAssumption:
        """``balanced``, ``capacity:<factor>`` or ``counts:<c0>,<c1>,...[;<next MoE layer>...]``."""
        if not isinstance(text, str):
            raise ConfigError(f"moe_routing_assumption={shorten(text)}: write {_ROUTING_FORMS}")
        kind, _, arg = text.strip().lower().partition(":")
        try:
            if kind == "capacity":  # numbers in digits 0-9 (NOTE [ASCII digits] in remat.units)
                factor = ascii_float(arg.strip())
                if factor is None or not factor > 0 or factor == float("inf"):
                    raise ValueError
                return cls("capacity", capacity_factor=factor)
            if kind == "counts":
                read = [[ascii_int(c.strip(), signed=False) for c in layer.split(",")] for layer in arg.split(";")]
                counts = tuple(tuple(c for c in layer if c is not None) for layer in read)
                if [len(layer) for layer in counts] != [len(layer) for layer in read]:
                    raise ValueError
                return cls("counts", counts=counts)
        except ValueError:
            raise ConfigError(f"moe_routing_assumption={shorten(text)}: write {_ROUTING_FORMS}") from None
        if arg or kind != "balanced":
            raise ConfigError(f"moe_routing_assumption={shorten(text)}: write {_ROUTING_FORMS}")
        return cls()

    def __str__(self) -> str:
        if self.kind == "capacity":
            return f"capacity:{self.capacity_factor:g}"
        if self.kind == "counts":
            return "counts:" + ";".join(",".join(map(str, layer)) for layer in self.counts)
        return "balanced"

    @property
    def per_layer(self) -> bool:
        """Whether the MoE layers receive different counts (so they are not interchangeable)."""
        return len(set(self.counts)) > 1

    def tokens_per_expert(self, tokens: int, experts: int, topk: int, layer: int = 0) -> list[int]:
        """Tokens each of ``experts`` experts receives in MoE layer ``layer`` (0 = the first MoE layer; with one
        count list, every MoE layer) from ``tokens`` tokens routed to ``topk`` experts each."""
        if self.kind == "counts":
            if layer >= len(self.counts) and len(self.counts) > 1:
                raise ConfigError(f"moe_routing_assumption gives counts for {len(self.counts)} MoE layers; MoE layer "
                                  f"{layer} has none: give one list per MoE layer, or one for all")
            counts = list(self.counts[min(layer, len(self.counts) - 1)])
            if len(counts) != experts:
                raise ConfigError(f"moe_routing_assumption={shorten(str(self))}: {len(counts)} counts, but the model "
                                  f"has {experts} experts: give one count per expert")
        elif self.kind == "capacity":
            counts = [math.ceil(tokens * topk / experts * float(self.capacity_factor or 1.0))] * experts
        else:
            base, extra = divmod(tokens * topk, experts)
            counts = [base + (e < extra) for e in range(experts)]
        if any(c > tokens for c in counts):
            raise ConfigError(f"moe_routing_assumption={shorten(str(self))}: an expert would receive {max(counts)} "
                              f"tokens, more than the {tokens} of the micro-batch; lower the factor or the counts")
        return counts


def parse_layer_freq(text: str, num_layers: int) -> int | tuple[int, ...]:
    """Megatron's ``--moe-layer-freq`` text: an integer, or a list written ``([0]*3+[1]*58)`` or ``[0,1,1]``
    (read without evaluating anything)."""
    body = text.strip()
    if re.fullmatch(r"[0-9]{1,18}", body):
        return int(body)
    body = body.removeprefix("(").removesuffix(")").replace(" ", "")
    runs: list[tuple[list[int], int]] = []
    length = 0  # counted before anything is repeated: ([1]*500000000) is refused without building it
    for term in body.split("+"):
        match = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*([0-9]+))?", term)
        if not match:
            raise ConfigError(f"moe_layer_freq={shorten(text)}: write an integer or a list such as ([0]*3+[1]*"
                              f"{max(num_layers - 3, 1)})")
        items, times = [int(x) for x in match.group(1).split(",")], match.group(2) or "1"
        runs.append((items, int(times) if len(times) <= 18 else num_layers + 1))
        length += len(items) * runs[-1][1]
        if length > num_layers:
            raise ConfigError(f"moe_layer_freq={shorten(text)} lists more than num_layers={num_layers} layers: a list "
                              f"needs one 0 (dense) or 1 (MoE) per layer, e.g. [0]*3+[1]*{max(num_layers - 3, 1)}")
    return tuple(x for items, times in runs for x in items * times)
