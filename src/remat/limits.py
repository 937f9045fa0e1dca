"""remat's bounds on its inputs: the largest size of a model or job it accepts, and how much of a user's file it reads.

A huge value (``--layers 100000``, ``--hidden-size 4000000000``, ``--dp 1000000000``) would make remat work or
allocate for minutes (or overflow a tensor's size) before anything could tell that no real job is that large. Every
size is checked against its ceiling first, before any work, and refused naming the field or flag; the ceilings are
the largest value of a real training job (published configurations, :mod:`remat.presets`, Megatron-LM's
functional tests in ``benchmarks/data/megatron_golden_h100_dev.json``) with a margin of 4x or more. Raise one in
:data:`CEILINGS` if a real job needs more.

================================  ============  ===============================================================
size (ModelConfig / Job field)    ceiling       the largest real jobs
================================  ============  ===============================================================
num_layers (and per chunk, MTP)   1,024         128 layers (Megatron-LM's 1T GPT; Llama 3 405B 126, GPT-3 96)
hidden_size (head dims, ranks)    65,536        25,600 (Megatron-LM's 1T GPT; MT-NLG 530B 20,480)
ffn_hidden_size (MoE, shared)     524,288       102,400 (4 x 25,600; 8 x hidden for Gemma-style MLPs)
num_attention_heads (groups)      1,024         160 heads (Megatron-LM's 1T GPT; DeepSeek-V3, Llama 3 405B 128)
vocab_size                        2,097,152     262,144 tokens (Gemma 3; Gemma 256,000, Llama 3 128,256)
seq_length                        8,388,608     4M-token contexts (long-context continued pre-training)
micro_batch_size                  65,536        a few hundred short sequences (BERT-style); 1-16 for LLMs
tokens per micro-batch (b x s)    8,388,608     4M (one 4M-token sequence; 512 x 2,048 = 1M)
num_moe_experts (top-k)           4,096         384 experts (Kimi K2; DeepSeek-V3 256)
tp, etp, cp, ep, vpp, pp          1,024         tp 8-64, cp 32, ep 64, pp 16-64, vpp ~16
dp, world size                    1,048,576     ~100,000 GPUs (Llama 3 405B: 16,384)
num_microbatches                  1,048,576     a few thousand (global batch / (micro-batch x dp))
================================  ============  ===============================================================

The tokens-per-micro-batch ceiling keeps the largest tensor of a step (math attention's ``b x heads x s x s``
scores: at most 2^56 elements) inside the 2^63 bytes a tensor's size can hold, for any sizes within the ceilings.

Files: a user's file (``--config FILE``, ``--megatron-args @FILE``) is read up to :data:`MAX_INPUT_FILE_BYTES` (a
model config or a Megatron command line is a few KiB); a longer one (``/dev/zero``) is refused without reading
further. YAML is read by a ``yaml.SafeLoader`` that allows at most :data:`MAX_YAML_ALIASES` aliases (``*name``) and
:data:`MAX_YAML_NODES` values once the aliases are expanded, so a "billion laughs" file cannot make a small file
describe a huge structure. Error messages cut long values (:func:`shorten`).
"""

from __future__ import annotations

import os
import reprlib
from typing import Any

MAX_INPUT_FILE_BYTES = 1 << 20
"""Bytes remat reads of one user file (1 MiB); a longer file is refused by name."""
MAX_YAML_ALIASES = 64
"""Aliases (``*name``, merge keys included) a YAML file may use: a config needs a handful at most; a limit keeps a
small file from describing an exponentially large structure (aliases of aliases)."""
MAX_YAML_NODES = 100_000
"""Values (scalars, lists, mappings) a YAML document may hold with every alias expanded."""
MAX_LAYOUT_ITEMS = 4096
"""Items (E, t, m, L and the ``|`` between chunks) of an unrolled ``--pipeline-model-parallel-layout``: every layer
(at most the num_layers ceiling, 1,024) and every chunk boundary, with room to spare; a longer one is refused
before its repetitions are written out."""
MAX_MESSAGE_VALUE = 80
"""Characters of a user's value an error message shows (:func:`shorten`)."""

_WIDE = 1 << 20
_LAYERS = (1024, "the largest real jobs have ~128 layers: Megatron-LM's 1T GPT 128, Llama 3 405B 126")
_HIDDEN = (1 << 16, "the largest real hidden size is 25,600, Megatron-LM's 1T GPT")
_FFN = (1 << 19, "the largest real FFN sizes are ~100,000: 4 x 25,600")
_HEADS = (1024, "the largest real jobs have 128-160 attention heads")
_PARALLEL = (1024, "the largest real jobs use tp 8-64, cp 32, ep 64, pp 16-64")
_EXPERTS = (4096, "the largest real MoE models have 256-384 experts")
_MICROBATCHES = (_WIDE, "real jobs run a few thousand microbatches per step at most")

#: field -> (ceiling, the largest real jobs, said in the refusal); the docstring's table.
CEILINGS: dict[str, tuple[int, str]] = {
    "num_layers": _LAYERS, "mtp_num_layers": _LAYERS,
    "hidden_size": _HIDDEN, "kv_channels": _HIDDEN, "q_lora_rank": _HIDDEN, "kv_lora_rank": _HIDDEN,
    "qk_head_dim": _HIDDEN, "qk_pos_emb_head_dim": _HIDDEN, "v_head_dim": _HIDDEN,
    "ffn_hidden_size": _FFN, "moe_ffn_hidden_size": _FFN, "moe_shared_expert_intermediate_size": _FFN,
    "num_attention_heads": _HEADS, "num_query_groups": _HEADS,
    "vocab_size": (1 << 21, "the largest real vocabularies have ~262,144 tokens, Gemma 3's"),
    "seq_length": (1 << 23, "the longest real training contexts are ~4M tokens"),
    "micro_batch_size": (1 << 16, "real micro-batches hold 1 to a few hundred sequences"),
    "tokens_per_microbatch": (1 << 23, "a real micro-batch holds at most ~4M tokens, one 4M-token sequence"),
    "num_moe_experts": _EXPERTS, "moe_router_topk": _EXPERTS, "expert_model_parallel_size": _PARALLEL,
    "tp": _PARALLEL, "etp": _PARALLEL, "cp": _PARALLEL, "ep": _PARALLEL, "pp": _PARALLEL, "vpp": _PARALLEL,
    "dp": (_WIDE, "the largest real jobs run on ~100,000 GPUs"),
    "world_size": (_WIDE, "the largest real jobs run on ~100,000 GPUs"),
    "distributed_optimizer_instances": (_WIDE, "the largest real jobs run on ~100,000 GPUs"),
    "num_microbatches": _MICROBATCHES, "microbatch_group_size": _MICROBATCHES,
}


def ceiling_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is too large for the size ``name`` (a key of :data:`CEILINGS`), or None (also for a value that
    is not an integer: the caller's own checks refuse it).

    The text starts with "is above": the caller puts the flag or field and the value before it.

    Example:
        >>> ceiling_problem("num_layers", 100_000)[:33]
        "is above remat's ceiling of 1,024"
        >>> ceiling_problem("num_layers", 96) is None
        True
    """
    ceiling, why = CEILINGS[name]
    if isinstance(value, bool) or not isinstance(value, int) or value <= ceiling:
        return None
    return (f"is above remat's ceiling of {ceiling:,} ({why}); remat refuses larger sizes before doing any work: "
            f"give at most {ceiling:,}")


def shorten(value: Any, limit: int = MAX_MESSAGE_VALUE) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters (``...`` where cut); a long string,
    list or nested structure is never formatted whole.

    Example:
        >>> shorten("Et" * 100, 20)
        "'EtEtEtE...EtEtEtEt'"
    """
    short = reprlib.Repr()
    short.maxstring = short.maxother = max(limit, 8)
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 8
    short.maxlevel, short.maxlong = 3, max(limit, 8)
    try:
        text = short.repr(value)
    except ValueError:  # an integer too long for str() (over 4,300 digits)
        text = f"<an integer of {value.bit_length():,} bits>" if isinstance(value, int) else "<a value>"
    return text if len(text) <= limit + 8 else text[:limit // 2] + "..." + text[-(limit // 2):]


class InputTooLarge(OSError):
    """A user's file longer than :data:`MAX_INPUT_FILE_BYTES`."""


def read_input_text(path: str | os.PathLike[str], limit: int = MAX_INPUT_FILE_BYTES) -> str:
    """The text of a user's file, read as UTF-8 up to ``limit`` bytes.

    Raises:
        InputTooLarge: (an OSError) the file holds more than ``limit`` bytes (``/dev/zero`` included: at most
            ``limit + 1`` bytes are read).
        OSError, UnicodeDecodeError: as ``open`` and decoding raise them.
    """
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputTooLarge(f"more than {limit:,} bytes, remat's limit for an input file (MAX_INPUT_FILE_BYTES): "
                            "give the file itself, not a device or a large file")
    return data.decode("utf-8")
