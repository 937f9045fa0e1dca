"""Megatron-LM's pipeline layouts: how many decoder layers each model chunk of a :class:`remat.job.Job` builds.

Megatron splits ``--num-layers`` over ``pp`` pipeline stages (``vpp`` model chunks each under the interleaved
schedule; global chunk ``g = v * pp + r`` runs on stage ``r``) in one of four ways, read from megatron-core 0.16
(``transformer/transformer_block.py::get_num_layers_to_build``, ``transformer/transformer_layer.py::
get_transformer_layer_offset``, ``transformer/transformer_config.py::__post_init__`` and
``transformer/pipeline_parallel_layer_layout.py``); every way's layer offsets are the running sum of the counts in
global chunk order, which is how :func:`chunk_layer_counts` returns them:

* even: ``num_layers / pp`` per stage, ``/ vpp`` per chunk (both must divide).
* ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers K`` (either or both): the first
  (last) stage builds F (K) layers, ``F / vpp`` in each of its chunks; the other ("middle") stages share the rest
  evenly. Refused as Megatron refuses: F, K > 0 and divisible by vpp; middle layers exactly when there are middle
  stages, divisible by them, and per middle stage by vpp.
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the embedding (loss)
  counts as one more layer: ``(num_layers + e + l) / pp`` per stage, ``/ vpp`` per chunk, and the first (last)
  chunk builds one decoder layer fewer (it may build none). Not with F/K.
* ``--pipeline-model-parallel-layout`` (:func:`parse_layout`): the chunks spelled out, ``|`` between chunks in
  global order, ``E`` embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` loss, ``X*n`` and ``(...)*n``
  repetition, commas cosmetic; ``pp`` divides the chunk count, whose quotient is vpp. Not with the other flags.

remat builds the embedding on chunk 0 and the final norm, output layer and loss on the last chunk (as Megatron's
``pre_process``/``post_process`` do whatever the layout), so a layout must put ``E`` in the first chunk and ``L`` in
the last; it has no MTP layers, so ``m`` is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from remat.job_flags import JobError
from remat.limits import CEILINGS, MAX_LAYOUT_ITEMS, shorten

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
DEFER_FLAG, LIMIT_FLAG = "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit"
LAYOUT_CHARS = {"E": "embedding", "t": "decoder layer", "m": "MTP layer", "L": "loss"}


@dataclass(frozen=True)
class LayoutChunk:
    """One model chunk of a ``--pipeline-model-parallel-layout``: its items in order, e.g. ``"Ett"``."""

    items: str

    @property
    def num_layers(self) -> int:
        """Decoder layers (``t``) in the chunk."""
        return self.items.count("t")


def parse_layout(text: str, pp: int) -> list[LayoutChunk]:
    """The model chunks of a Megatron ``--pipeline-model-parallel-layout`` string, in global chunk order.

    Args:
        text: the layout, Megatron's grammar (``PipelineParallelLayerLayout.parse_str_to_list``): commas dropped,
            ``(...)*n`` then ``X*n`` unrolled, chunks split at ``|``; characters E, t, m, L.
        pp: the pipeline-parallel size, which must divide the number of chunks (the quotient is vpp).

    Returns:
        One :class:`LayoutChunk` per global chunk (chunk g runs on stage g % pp). Raises :class:`JobError` naming
        the flag and the fix for an unknown character, a chunk count pp does not divide, E not first / L not last
        (exactly once each), or an MTP layer ``m``.

    Example:
        >>> [c.items for c in parse_layout("Et*3|(tt|)*2L", 2)]  # (tt|)*2 is 'tt|tt|'
        ['Ettt', 'tt', 'tt', 'L']
    """
    if not isinstance(text, str) or not text.strip():
        raise JobError(f"{LAYOUT_FLAG} {text!r}: give a layout string, e.g. 'Ett|ttL' (E embedding, t decoder "
                       "layer, L loss, | between chunks)")
    unrolled = text.strip().replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):  # Megatron's order: groups, then single characters
        unrolled = _unroll(text, unrolled, pattern)
    chunks = [LayoutChunk(part) for part in unrolled.split("|")]
    bad = sorted({ch for c in chunks for ch in c.items if ch not in LAYOUT_CHARS})
    if bad:
        shown = ", ".join(map(repr, bad[:8])) + ", ..." * (len(bad) > 8)
        raise JobError(f"{LAYOUT_FLAG} {shorten(text)}: unknown character(s) {shown} (after unrolling the "
                       f"repetitions: {shorten(unrolled)}); use only E (embedding), t (decoder layer), m (MTP), L "
                       "(loss), | between chunks, X*n and (...)*n")
    if any("m" in c.items for c in chunks[:-1]) or "m" in chunks[-1].items.rstrip("mL"):
        # remat builds the MTP depths after the loss chunk's decoder layers (models.gpt), as Megatron does on the
        # stage whose layout ends ...mL
        raise JobError(f"{LAYOUT_FLAG} {text!r} places MTP layers (m) before the last chunk's decoder layers end: "
                       "remat models them where Megatron puts them by default, after the last decoder layer and "
                       "before the loss (...tmL); move the m's there")
    if len(chunks) % pp:
        raise JobError(f"{LAYOUT_FLAG} {text!r} has {len(chunks)} chunks, not a multiple of pp={pp} "
                       "(--pipeline-model-parallel-size): Megatron gives every stage the same number of chunks (vpp); "
                       f"give pp x vpp chunks")
    joined = "".join(c.items for c in chunks)
    if joined.count("E") != 1 or joined.count("L") != 1:
        raise JobError(f"{LAYOUT_FLAG} {text!r}: Megatron needs exactly one E (embedding) and one L (loss); "
                       f"it has {joined.count('E')} and {joined.count('L')}")
    if not chunks[0].items.startswith("E") or not chunks[-1].items.endswith("L"):
        raise JobError(f"{LAYOUT_FLAG} {text!r}: the embedding E must open the first chunk and the loss L end the "
                       "last (Megatron builds them on the first and last pipeline stage whatever the layout); move "
                       "them there")
    return chunks


def _unroll(text: str, layout: str, pattern: str) -> str:
    """``layout`` with ``pattern``'s repetitions (group 1, group 2 times) written out; refused, naming ``text`` (the
    flag's value), when the result would be longer than :data:`remat.limits.MAX_LAYOUT_ITEMS`, before building it."""
    length = len(layout)
    for match in re.finditer(pattern, layout):
        if length > MAX_LAYOUT_ITEMS:
            break
        times = int(match.group(2)) if len(match.group(2)) <= 9 else MAX_LAYOUT_ITEMS
        length += len(match.group(1)) * times - len(match.group(0))
    if length > MAX_LAYOUT_ITEMS:
        raise JobError(f"{LAYOUT_FLAG} {shorten(text)} unrolls to more than {MAX_LAYOUT_ITEMS:,} items (E, t, m, L and "
                       f"the | between chunks), remat's ceiling (at most {CEILINGS['num_layers'][0]:,} layers): "
                       "write the job's real layout")
    return re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), layout)


def layout_vpp(text: str, pp: int) -> int | None:
    """The vpp a layout implies: its chunk count / pp, None when that is 1 (Megatron's convention)."""
    vpp = len(parse_layout(text, pp)) // pp
    return vpp if vpp > 1 else None


def chunk_layer_counts(num_layers: int, pp: int, vpp: int | None = None, *, first: int | None = None,
                       last: int | None = None, account_for_embedding: bool = False,
                       account_for_loss: bool = False, layout: str | None = None,
                       mtp_layers: int = 0) -> tuple[int, ...]:
    """Decoder layers of every model chunk, in global chunk order, as Megatron builds them.

    Args:
        num_layers: ``--num-layers``.
        pp: ``--pipeline-model-parallel-size``.
        vpp: model chunks per stage (None: one).
        first, last: ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``.
        account_for_embedding, account_for_loss: the ``--account-for-*-in-pipeline-split`` switches.
        layout: ``--pipeline-model-parallel-layout``; vpp must equal the one it implies.
        mtp_layers: ``--mtp-num-layers``: a layout that places MTP layers (``m``) must place that many.

    Returns:
        ``pp * vpp`` counts adding up to ``num_layers`` (chunk g's first layer is the sum of the counts before
        it). A chunk may build no decoder layer only when it holds the embedding or the loss. Raises
        :class:`JobError` naming the flag and the fix for every split Megatron refuses.

    Example:
        >>> chunk_layer_counts(61, 4, first=13, last=12)
        (13, 18, 18, 12)
        >>> chunk_layer_counts(7, 2, 2, account_for_embedding=True)
        (1, 2, 2, 2)
    """
    v = vpp or 1
    uneven, account = first is not None or last is not None, account_for_embedding or account_for_loss
    if layout is not None:
        others = [f for f, on in ((FIRST_FLAG, first is not None), (LAST_FLAG, last is not None),
                                  (EMBEDDING_FLAG, account_for_embedding), (LOSS_FLAG, account_for_loss)) if on]
        if others:
            raise JobError(f"{LAYOUT_FLAG} with {', '.join(others)}: Megatron refuses the layout together with the "
                           "other pipeline-split flags; keep the layout (it says everything) or drop it")
        chunks = parse_layout(layout, pp)
        if len(chunks) != pp * v:
            want = len(chunks) // pp
            raise JobError(f"{LAYOUT_FLAG} {layout!r} has {len(chunks)} chunks = pp {pp} x {want}, but vpp="
                           f"{vpp} (--num-virtual-stages-per-pipeline-rank): Megatron asserts they agree; use vpp="
                           f"{want if want > 1 else None}, or drop the vpp flag (the layout implies it)")
        placed = sum(c.items.count("m") for c in chunks)
        if placed and placed != mtp_layers:
            raise JobError(f"{LAYOUT_FLAG} {layout!r} places {placed} MTP layer(s) (m) but --mtp-num-layers is "
                           f"{mtp_layers}: make them equal")
        counts = tuple(c.num_layers for c in chunks)
        if sum(counts) != num_layers:
            raise JobError(f"{LAYOUT_FLAG} {layout!r} places {sum(counts)} decoder layers (t) but --num-layers is "
                           f"{num_layers}: make them equal")
        empty = [g for g, c in enumerate(chunks) if not c.items]
        if empty:
            raise JobError(f"{LAYOUT_FLAG} {layout!r}: chunk {empty[0]} is empty (no E, t or L), which remat cannot "
                           "price yet (its stage only passes hidden states on); give every chunk a layer")
        return counts
    if uneven and account:
        raise JobError(f"{FIRST_FLAG}/{LAST_FLAG} with {EMBEDDING_FLAG}/{LOSS_FLAG}: Megatron refuses them "
                       "together; use one way of splitting (or --pipeline-model-parallel-layout)")
    if uneven:
        middle_layers, middle_stages = num_layers, pp
        for flag, n in ((FIRST_FLAG, first), (LAST_FLAG, last)):
            if n is None:
                continue
            if n <= 0:
                raise JobError(f"{flag} {n}: must be larger than 0")
            if n % v:
                raise JobError(f"{flag} {n} is not divisible by vpp={v} (--num-virtual-stages-per-pipeline-rank): "
                               f"Megatron splits the stage's layers evenly over its chunks; use a multiple of {v}")
            middle_layers -= n
            middle_stages -= 1
        if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
            raise JobError(f"{FIRST_FLAG}/{LAST_FLAG} leave {middle_layers} of --num-layers {num_layers} for "
                           f"{max(middle_stages, 0)} middle stage(s) of pp={pp}: Megatron needs middle layers "
                           "exactly when there are middle stages; change the first/last counts or pp")
        per_stage = middle_layers // middle_stages if middle_stages else 0
        if middle_stages and (middle_layers % middle_stages or per_stage % v):
            raise JobError(f"{FIRST_FLAG}/{LAST_FLAG} leave {middle_layers} layers for {middle_stages} middle "
                           f"stage(s){f' of vpp={v} chunks' if v > 1 else ''}: Megatron splits them evenly, so "
                           f"{middle_stages * v} must divide {middle_layers}; change the first/last counts so that "
                           "it does")
        stage = [per_stage] * pp
        if first is not None:
            stage[0] = first
        if last is not None:
            stage[-1] = last
        return tuple(stage[r] // v for _ in range(v) for r in range(pp))
    total = num_layers + account_for_embedding + account_for_loss
    if total % pp or (total // pp) % v:
        what = (f"--num-layers {num_layers}" + f" + 1 ({EMBEDDING_FLAG})" * account_for_embedding
                + f" + 1 ({LOSS_FLAG})" * account_for_loss)
        where = f"pp * vpp = {pp} * {v}" if v > 1 else f"pp = {pp}"
        raise JobError(f"{what} = {total} layers are not divisible by {where}: Megatron splits them evenly over "
                       f"the pipeline chunks; use a {'pp * vpp' if v > 1 else 'pp'} dividing {total}, or an "
                       f"uneven split ({FIRST_FLAG} / "
                       f"{LAST_FLAG}, or {LAYOUT_FLAG})")
    counts = [total // (pp * v)] * (pp * v)
    counts[0] -= account_for_embedding
    counts[-1] -= account_for_loss
    if counts[0] < 0 or counts[-1] < 0 or sum(counts) != num_layers:
        raise JobError(f"{EMBEDDING_FLAG}/{LOSS_FLAG} with one chunk: the embedding and loss take its only layer "
                       "slot; use more layers or drop a flag")
    return tuple(counts)


def layout_args(first: int | None, last: int | None, account_for_embedding: bool, account_for_loss: bool,
                layout: str | None) -> list[str]:
    """The Megatron flags of a pipeline split (the inverse of reading them)."""
    return ([FIRST_FLAG, str(first)] * (first is not None) + [LAST_FLAG, str(last)] * (last is not None)
            + [EMBEDDING_FLAG] * account_for_embedding + [LOSS_FLAG] * account_for_loss
            + [LAYOUT_FLAG, layout] * (layout is not None))


# ------------------------------------------------------------------ the Job's side (duck-typed: job imports this)
def check_pipeline_split(job: Any) -> str:
    """Validate a Job's pipeline split (its fields named as Megatron's flags); return its kind:
    ``'even'``, ``'uneven'`` (first/last counts), ``'account'`` (embedding/loss counted) or ``'layout'``."""
    check_wgrad_deferral(job)
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        v = getattr(job, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise JobError(f"{name} ({FLAG_OF[name]})={v!r}: must be a positive integer or None")
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if not isinstance(getattr(job, name), bool):
            raise JobError(f"{name} ({FLAG_OF[name]})={getattr(job, name)!r}: must be True or False")
    layout = job.pipeline_model_parallel_layout
    if layout is not None and not isinstance(layout, str):
        raise JobError(f"pipeline_model_parallel_layout ({LAYOUT_FLAG})={layout!r}: must be a layout string or None")
    if layout is not None:
        kind = "layout"
    elif job.decoder_first_pipeline_num_layers is not None or job.decoder_last_pipeline_num_layers is not None:
        kind = "uneven"
    elif job.account_for_embedding_in_pipeline_split or job.account_for_loss_in_pipeline_split:
        kind = "account"
    else:
        L, vpp = job.model.num_layers, job.vpp
        chunks, where = job.pp * (vpp or 1), "pp" if vpp is None else "pp*vpp"
        if chunks > L:
            raise JobError(f"{where}={chunks} pipeline chunks exceed num_layers={L} (--num-layers): every chunk "
                           f"needs a layer; use {where} <= {L}")
        # megatron/training/arguments.py::validate_args: "Number of layers should be divisible by the
        # pipeline-model-parallel size", and per stage by the layers per virtual stage
        if L % chunks:
            divisors = ", ".join(str(d) for d in range(1, L + 1) if L % d == 0)
            raise JobError(f"num_layers={L} (--num-layers) is not divisible by {where}={chunks}: Megatron splits "
                           f"the layers evenly over the pipeline chunks; use {where} from {divisors}, or an uneven "
                           f"split ({FIRST_FLAG} / {LAST_FLAG}, or {LAYOUT_FLAG})")
        return "even"
    job_chunk_layers(job)  # refuses what Megatron refuses
    return kind


def check_wgrad_deferral(job: Any) -> None:
    """Megatron's checks of ``--defer-embedding-wgrad-compute`` (model_parallel_config.py:545-557): pipeline
    parallelism, gradient-accumulation fusion and a limit >= 0; what it keeps: remat.parallel.deferred_wgrad."""
    n = job.embedding_wgrad_deferral
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise JobError(f"embedding_wgrad_deferral ({LIMIT_FLAG})={n!r}: must be an integer >= 0 (0: every "
                       "microbatch) or None (no deferral)")
    if job.pp == 1:
        raise JobError(f"{DEFER_FLAG} needs pipeline parallelism (Megatron refuses it with "
                       "--pipeline-model-parallel-size 1): drop it, or set pp > 1")
    if not job.gradient_accumulation_fusion:
        raise JobError(f"{DEFER_FLAG} needs gradient-accumulation fusion (Megatron refuses it with "
                       "--no-gradient-accumulation-fusion): drop one of them")
    if job.model.mtp_num_layers:  # gpt_model.py: the MTP depths call the output layer too, each filling the buffer
        raise JobError(f"{DEFER_FLAG} with multi-token prediction (--mtp-num-layers): the MTP depths' logits go "
                       "through the same output layer, which remat's deferral does not model yet; drop one of them")


def job_chunk_layers(job: Any) -> tuple[int, ...]:
    """:func:`chunk_layer_counts` of a Job."""
    return chunk_layer_counts(job.model.num_layers, job.pp, job.vpp, first=job.decoder_first_pipeline_num_layers,
                              last=job.decoder_last_pipeline_num_layers,
                              account_for_embedding=job.account_for_embedding_in_pipeline_split,
                              account_for_loss=job.account_for_loss_in_pipeline_split,
                              layout=job.pipeline_model_parallel_layout, mtp_layers=job.model.mtp_num_layers or 0)


def pipeline_split_args(job: Any) -> list[str]:
    """The Megatron flags of a Job's pipeline split (none for an even one), of its microbatch groups and of its
    deferred output-layer weight gradients."""
    group = [GROUP_FLAG, str(job.microbatch_group_size)] if job.microbatch_group_size is not None else []
    if job.embedding_wgrad_deferral is not None:
        group += [DEFER_FLAG, LIMIT_FLAG, str(job.embedding_wgrad_deferral)]
    return layout_args(job.decoder_first_pipeline_num_layers, job.decoder_last_pipeline_num_layers,
                       job.account_for_embedding_in_pipeline_split, job.account_for_loss_in_pipeline_split,
                       job.pipeline_model_parallel_layout) + group


def check_microbatch_groups(job: Any) -> None:
    """Megatron's checks of the interleaved schedule's microbatch groups (megatron/core/pipeline_parallel/
    schedules.py:1160-1180 at d98e8a64): ``microbatch_group_size_per_vp_stage`` (default pp) lies in [pp, m], and a
    last group of fewer than pp microbatches is refused (with the default: m must be a multiple of pp)."""
    g, m, pp = job.microbatch_group_size, job.num_microbatches, job.pp
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
        raise JobError(f"microbatch_group_size ({GROUP_FLAG})={g!r}: must be a positive integer or None")
    if job.vpp is None:
        if g is not None:
            raise JobError(f"microbatch_group_size ({GROUP_FLAG})={g} is for the interleaved schedule: set vpp, or "
                           "use None")
        return
    if g is None:
        if m % pp:
            raise JobError(f"num_microbatches (--global-batch-size)={m}: Megatron's interleaved schedule needs a "
                           f"multiple of pp={pp} (or {GROUP_FLAG}); change --global-batch-size")
        return
    problem = microbatch_group_problem(g, pp, m)
    if problem:
        raise JobError(problem)


def microbatch_group_problem(g: int, pp: int, m: int) -> str | None:
    """What Megatron refuses in a microbatch group size ``g`` with ``pp`` stages and ``m`` microbatches
    (schedules.py:1160-1180 at d98e8a64: pp <= g <= m, and no last group of fewer than pp), or None.

    Example:
        >>> microbatch_group_problem(5, 4, 10) is None, microbatch_group_problem(5, 4, 11)[:32]
        (True, 'microbatches=11 (--global-batch-')
    """
    if not pp <= g <= m:
        return (f"microbatch group size {g} ({GROUP_FLAG}) must lie in [pp, microbatches] = [{pp}, {m}], as Megatron "
                f"checks: use {min(max(g, pp), m) if pp <= m else pp} (or microbatches >= {pp}: --global-batch-size)")
    if 0 < m % g < pp:
        return (f"microbatches={m} (--global-batch-size) leave a last group of {m % g} < pp={pp} microbatches (group "
                f"size {g}, {GROUP_FLAG}), which Megatron refuses: use microbatches={m - m % g} or {m - m % g + g}")
    return None


def pipeline_split_fields(got: dict[str, Any], num_layers: int, pp: int) -> tuple[int | None, dict[str, Any]]:
    """Read the pipeline-split flags (and vpp) of a parsed command line (``got``: flag -> value).

    Returns:
        ``(vpp, fields)``: vpp from ``--num-virtual-stages-per-pipeline-rank``, from
        ``--num-layers-per-virtual-pipeline-stage`` (per stage: ``(num_layers + e + l) / pp``, as Megatron's
        arguments.py counts it) or implied by the layout, None for one chunk per stage; ``fields`` the Job fields.
    """
    lpvs, vpp = got.get("--num-layers-per-virtual-pipeline-stage"), got.get("--num-virtual-stages-per-pipeline-rank")
    fields = {"decoder_first_pipeline_num_layers": got.get(FIRST_FLAG),
              "decoder_last_pipeline_num_layers": got.get(LAST_FLAG),
              "account_for_embedding_in_pipeline_split": bool(got.get(EMBEDDING_FLAG)),
              "account_for_loss_in_pipeline_split": bool(got.get(LOSS_FLAG)),
              "pipeline_model_parallel_layout": got.get(LAYOUT_FLAG)}
    if lpvs is not None and vpp is not None:
        raise JobError("give one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-"
                       "rank (Megatron asserts at most one)")
    if lpvs is not None:
        if fields["pipeline_model_parallel_layout"] is not None:
            raise JobError(f"--num-layers-per-virtual-pipeline-stage with {LAYOUT_FLAG}: the layout gives every "
                           "chunk's layers (and so vpp); drop --num-layers-per-virtual-pipeline-stage")
        if got.get(FIRST_FLAG) is not None or got.get(LAST_FLAG) is not None:
            raise JobError(f"--num-layers-per-virtual-pipeline-stage with {FIRST_FLAG}/{LAST_FLAG}: Megatron asks "
                           "for --num-virtual-stages-per-pipeline-rank with an uneven split; use it instead")
        total = num_layers + fields["account_for_embedding_in_pipeline_split"] + \
            fields["account_for_loss_in_pipeline_split"]
        if total % pp or (total // pp) % lpvs:
            raise JobError(f"--num-layers-per-virtual-pipeline-stage {lpvs}: Megatron needs it to divide the "
                           f"layers of a pipeline stage (--num-layers {num_layers}"
                           + " + 1 counted embedding/loss" * (total - num_layers)
                           + f" / --pipeline-model-parallel-size {pp})")
        vpp = total // pp // lpvs
    if vpp is None and fields["pipeline_model_parallel_layout"] is not None:
        vpp = layout_vpp(fields["pipeline_model_parallel_layout"], pp)
    vpp = None if vpp == 1 else vpp
    # only the interleaved schedule reads the group size (schedules.py:1231); Megatron ignores it otherwise
    fields["microbatch_group_size"] = got.get(GROUP_FLAG) if vpp is not None else None
    # the limit is read only with the deferral (model_parallel_config.py:415, default 0: every microbatch)
    fields["embedding_wgrad_deferral"] = got.get(LIMIT_FLAG, 0) if got.get(DEFER_FLAG) else None
    return vpp, fields


FLAG_OF = {"decoder_first_pipeline_num_layers": FIRST_FLAG, "decoder_last_pipeline_num_layers": LAST_FLAG,
           "account_for_embedding_in_pipeline_split": EMBEDDING_FLAG, "account_for_loss_in_pipeline_split": LOSS_FLAG,
           "pipeline_model_parallel_layout": LAYOUT_FLAG}
