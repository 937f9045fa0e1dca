"""remat.job_pipeline against megatron-core itself: the layers every (stage, chunk) builds, their offsets, and the
splits megatron-core refuses."""

from __future__ import annotations

import itertools

import pytest

from remat.job_flags import JobError
from remat.job_pipeline import chunk_layer_counts
from remat.megatron.compat import MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

import torch  # noqa: E402
from megatron.core.transformer.enums import LayerType  # noqa: E402
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout  # noqa: E402
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

SPLITS = [  # (num_layers, pp, vpp, first, last, embedding, loss)
    (61, 16, None, 4, 1, False, False), (61, 4, None, 13, 12, False, False), (7, 3, None, 1, None, False, False),
    (10, 3, 2, 2, 4, False, False), (12, 4, 2, None, 2, False, False), (7, 4, None, None, None, True, False),
    (7, 2, 2, None, None, True, False), (6, 2, 2, None, None, True, True), (7, 2, 4, None, None, False, True),
    (61, 8, None, None, None, True, True), (8, 4, 2, None, None, False, False),
    # refused by megatron-core
    (7, 3, None, 2, None, False, False), (10, 3, 2, 3, 4, False, False), (7, 2, None, 7, None, False, False),
    (7, 3, None, None, None, False, True), (7, 3, None, 1, None, True, False), (8, 2, 2, 2, 3, False, False),
]


def megatron_counts(num_layers, pp, vpp, first, last, embedding, loss):
    """Layers of every chunk in global order from megatron-core's own functions, or the error it raises."""
    from megatron.core.transformer import TransformerConfig

    try:
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=embedding, account_for_loss_in_pipeline_split=loss)
        chunks = [(v, r) for v in range(vpp or 1) for r in range(pp)]
        counts = [get_num_layers_to_build(config, v if vpp else None, r) for v, r in chunks]
        offsets = [get_transformer_layer_offset(config, v if vpp else None, r) for v, r in chunks]
    except (ValueError, AssertionError) as err:
        return err
    return tuple(counts), offsets


@pytest.mark.parametrize("split", SPLITS, ids=[str(s) for s in SPLITS])
def test_chunk_layers_and_offsets_are_megatron_cores(split):
    num_layers, pp, vpp, first, last, embedding, loss = split
    expected = megatron_counts(*split)
    if isinstance(expected, Exception):
        with pytest.raises(JobError):
            chunk_layer_counts(num_layers, pp, vpp, first=first, last=last, account_for_embedding=embedding,
                               account_for_loss=loss)
        return
    counts = chunk_layer_counts(num_layers, pp, vpp, first=first, last=last, account_for_embedding=embedding,
                                account_for_loss=loss)
    assert counts == expected[0]
    assert list(itertools.accumulate((0,) + counts[:-1])) == expected[1]  # offsets: the running sum


@pytest.mark.parametrize("layout, pp", [("Et*2|(tt|)*22t|(tt|)*7L", 8), ("E|t*7L", 2), ("Ettt|L", 2),
                                        ("Et|(tt|)*2,ttL", 2)])
def test_layouts_build_megatron_cores_layers(layout, pp):
    parsed = PipelineParallelLayerLayout(layout, pp)
    v = parsed.virtual_pipeline_model_parallel_size
    expected = tuple(parsed.layout[r][k].count(LayerType.decoder) for k in range(v) for r in range(pp))
    num_layers = sum(expected)
    parsed.validate_layer_layout(num_layers, None)
    assert chunk_layer_counts(num_layers, pp, v if v > 1 else None, layout=layout) == expected
    assert [parsed.get_layer_offset(vp_stage=0, pp_rank=r) for r in range(pp)] == \
        list(itertools.accumulate((0,) + expected[:pp - 1]))
