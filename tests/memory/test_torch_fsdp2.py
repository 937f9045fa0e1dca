"""torch FSDP2 (remat.job_fsdp.TorchFsdp2Config, remat.memory.torch_fsdp2): flags and Megatron's refusals, the
padded shards, the gathers and reduce-scatters by phase, reshard-after-forward."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest

from remat.job import Job, JobError, parse_megatron_args
from remat.job_fsdp import TorchFsdp2Config
from remat.memory.rank_state import ParamInfo
from remat.memory.torch_fsdp2 import (
    ALL_GATHER_MODULE,
    GATHERED_MODULE,
    INIT_MODULE,
    REDUCE_SCATTER_MODULE,
    SHARDED_GRADS_MODULE,
    UNSHARDED_GRADS_MODULE,
    fsdp2_units,
    padded_shard,
)
from remat.parallel.job_measure import check_measurable
from remat.parallel.job_predict import RESIDENT_PARTS, parts_at, predict_stage, stage_parameters

# fc1 [130, 64] is not a multiple of dp = 4 (33 rows a shard, 2 of them padding); the vocab pads to 1024
FSDP2 = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 130 --seq-length 128 "
         "--micro-batch-size 2 --vocab-size 1000 --bf16 --world-size 4 --global-batch-size 16 "
         "--no-gradient-accumulation-fusion --untie-embeddings-and-output-weights --use-torch-fsdp2 ")


def _job(extra: str = "") -> Job:
    return parse_megatron_args(FSDP2 + extra)[0]


def _rows(timeline, module: str) -> list[tuple[int, int, int]]:
    return [(n, a, f) for n, a, f, m in zip(timeline.nbytes, timeline.alloc_at, timeline.free_at, timeline.module)
            if m == module]


def test_the_real_gloo_run_refuses_fsdp2() -> None:
    with pytest.raises(JobError, match="remat predict"):  # its ranks build Megatron's DDP buffers
        check_measurable(_job())


def test_flags_round_trip_and_defaults() -> None:
    job, ignored = parse_megatron_args(FSDP2 + "--ckpt-format torch_dist --overlap-grad-reduce")
    assert job.torch_fsdp2 == TorchFsdp2Config() and not job.distributed_optimizer and job.fsdp is None
    assert "--ckpt-format" in ignored
    assert Job.from_megatron_args(job.to_megatron_args()) == job
    kept = _job("--torch-fsdp2-no-reshard-after-forward")
    assert kept.torch_fsdp2 == TorchFsdp2Config(reshard_after_forward=False)
    assert Job.from_megatron_args(kept.to_megatron_args()) == kept


@pytest.mark.parametrize("argv, fragments", [
    # Megatron-LM d98e8a64 training/arguments.py:1031-1045 and the fix
    (FSDP2.replace("--no-gradient-accumulation-fusion ", ""),
     ["gradient accumulation fusion", "arguments.py:1040", "add --no-gradient-accumulation-fusion"]),
    (FSDP2.replace("--untie-embeddings-and-output-weights ", ""),
     ["--untie-embeddings-and-output-weights", "arguments.py:1044"]),
    (FSDP2 + "--use-distributed-optimizer", ["--use-distributed-optimizer", "arguments.py:1038", "drop it"]),
    (FSDP2 + "--pipeline-model-parallel-size 2", ["pipeline parallelism", "use pp=1"]),
    (FSDP2 + "--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall",
     ["expert parallelism", "use ep=1"]),
    (FSDP2 + "--ckpt-format torch", ["--ckpt-format torch", "use --ckpt-format torch_dist"]),
    (FSDP2 + "--ckpt-format torch_dcp --tensor-model-parallel-size 2", ["torch_dcp", "tensor parallelism"]),
    (FSDP2 + "--use-megatron-fsdp", ["--use-megatron-fsdp", "keep one"]),
    (FSDP2 + "--overlap-grad-reduce --overlap-param-gather", ["--overlap-param-gather", "drop it"]),
    (FSDP2 + "--optimizer muon", ["Torch-FSDP2", "use adam or sgd"]),
    # remat does not model these with FSDP2 yet
    (FSDP2 + "--fp8-format hybrid", ["--fp8-format", "not modelled yet"]),
    (FSDP2 + "--mtp-num-layers 1", ["--mtp-num-layers", "not modelled yet"]),
    (FSDP2.replace("--use-torch-fsdp2 ", "--torch-fsdp2-no-reshard-after-forward"),
     ["without --use-torch-fsdp2", "add --use-torch-fsdp2"]),
])
def test_refusals_name_the_flag_and_the_fix(argv: str, fragments: list[str]) -> None:
    with pytest.raises(JobError) as err:
        parse_megatron_args(argv)
    assert all(f in str(err.value) for f in fragments), str(err.value)


def test_sharded_state_is_each_parameters_padded_dim0_chunk() -> None:
    job = _job()
    params = stage_parameters(job, 0)[0]
    state = predict_stage(job, 0).state
    chunks = {p.name: math.ceil(p.shape[0] / 4) * (p.numel // p.shape[0]) for p in params}
    assert chunks["layers.0.mlp.linear_fc1.weight"] == 33 * 64  # 130 rows: 33 per rank, 132 with the padding
    assert chunks["embedding.word_embeddings.weight"] == 256 * 64
    shard = sum(chunks.values())
    assert state.shard_elements == shard and state.num_parameters == sum(p.numel for p in params)
    assert state.parameters + state.parameter_padding == 2 * shard  # bf16: no MixedPrecisionPolicy (:82-85)
    assert state.master_parameters == 4 * shard and state.optimizer_state == 8 * shard  # fp32 copy + Adam
    assert state.gradients == 0  # made by the first backward (rows of the timeline)
    units = fsdp2_units(job, params)
    assert [u.name for u in units] == ["root", "embedding", "layer 0", "layer 1", "output"]
    assert [p.name for p in units[0].params] == ["head.final_layernorm.weight", "head.final_layernorm.bias"]
    assert sum(u.shard_elements for u in units) == shard


def test_gathers_and_reduce_scatters_add_up() -> None:
    job = _job()
    params = stage_parameters(job, 0)[0]
    units = {u.name: u for u in fsdp2_units(job, params)}
    tl = predict_stage(job, 0).timeline
    layer = units["layer 0"]
    per_param = sum(4 * padded_shard(p, 4) * 2 for p in layer.params)
    # every parameter gathered into its own shards x padded-chunk tensor; the flat buffer and the reduce-scatter
    # input are shards x the unit's padded shards (_fsdp_collectives.py:351, 597)
    assert layer.gathered_bytes(2) == per_param == layer.flat_bytes(2)
    first = tl.phase_spans()[0][2]
    gathered = [n for n, a, _ in _rows(tl, GATHERED_MODULE)]
    assert gathered.count(per_param) == 2 * 2 * 2  # 2 layers x (forward, backward) x 2 microbatches
    assert per_param in [n for n, _, _ in _rows(tl, ALL_GATHER_MODULE)]
    reduce_scatters = [n for n, _, _ in _rows(tl, REDUCE_SCATTER_MODULE)]
    # every unit's, the embedding's too (its post-backward runs in the root's final callback: its inputs are ids)
    assert sorted(reduce_scatters) == sorted(2 * 4 * u.shard_elements for u in units.values() for _ in range(2))
    # autograd's unsharded weight gradients: the unit's parameters' own shapes, held to its post-backward; the
    # output layer's traced [vocab, h] gradient is kept to the head's backward end (not counted twice)
    assert sum(p.numel * 2 for p in layer.params) in [n for n, _, _ in _rows(tl, UNSHARDED_GRADS_MODULE)]
    heads = [(s, e) for ph, s, e in tl.phase_spans() if ph.kind == "backward" and ph.region == "head"]
    out = units["output"].params[0].numel * 2
    assert [f for n, a, f in _rows(tl, UNSHARDED_GRADS_MODULE) if n == out and any(s <= a < e for s, e in heads)] \
        == [e for _, e in heads]  # the traced gradient, one per microbatch, relabelled: not added a second time
    # the first microbatch's reduce-scatter outputs are the sharded gradients, one per unit, freed by the
    # optimizer step (its last event) for the fp32 copies the resident state holds
    sharded = _rows(tl, SHARDED_GRADS_MODULE)
    assert sorted(n for n, _, _ in sharded) == sorted(2 * u.shard_elements for u in units.values())
    assert {f for _, _, f in sharded} == {tl.num_events - 1} and all(a > first for _, a, _ in sharded)
    resident = parts_at(tl, tl.num_events - 1)
    state = predict_stage(job, 0).state
    assert resident["gradients"] == 4 * state.shard_elements
    assert resident["parameters"] == 2 * state.shard_elements
    assert {p: resident[p] for p in RESIDENT_PARTS if p not in ("gradients", "parameters", "workspaces")} == {
        "master_parameters": 4 * state.shard_elements, "optimizer_state": 8 * state.shard_elements, "activations": 0}


def test_no_reshard_after_forward_keeps_each_unit_gathered_to_its_backward() -> None:
    resharded, kept = _job(), _job("--torch-fsdp2-no-reshard-after-forward")
    params = stage_parameters(resharded, 0)[0]
    units = {u.name: u for u in fsdp2_units(resharded, params)}
    a, b = predict_stage(resharded, 0).timeline, predict_stage(kept, 0).timeline
    head = next(s for ph, s, _ in a.phase_spans() if ph.kind == "forward" and ph.region == "head")
    # at the head's forward, ZeRO-2 (no reshard) still holds the embedding's and both layers' bf16 parameters
    unit_bytes = sum(units[n].gathered_bytes(2) for n in ("embedding", "layer 0", "layer 1"))
    assert parts_at(b, head)["parameters"] - parts_at(a, head)["parameters"] == unit_bytes
    assert unit_bytes == 2 * 4 * sum(units[n].shard_elements for n in ("embedding", "layer 0", "layer 1"))
    # and gathers nothing in backward: one gather per unit and microbatch, not two
    assert len(_rows(b, GATHERED_MODULE)) * 2 == len(_rows(a, GATHERED_MODULE))
    assert b.peak_bytes > a.peak_bytes


def test_full_recompute_keeps_the_last_recomputed_units_flat_buffer_past_the_step() -> None:
    # a recompute's pre-forward copies out in FORWARD state: its flat buffer waits for the next FORWARD copy-out
    # (_fsdp_param_group.py:478-489), the next step's first (_fsdp_state.py:335 frees only the forward's last)
    job = _job("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    layer = next(u for u in fsdp2_units(job, stage_parameters(job, 0)[0]) if u.name == "layer 0")
    tl = predict_stage(job, 0).timeline
    held = [(n, a) for n, a, f in _rows(tl, ALL_GATHER_MODULE) if f == -1]
    assert held == [(layer.flat_bytes(2), held[0][1])]
    assert parts_at(tl, tl.num_events - 1)["communication"] == layer.flat_bytes(2)


def test_model_initialisation_counts_the_whole_model_before_fully_shard() -> None:
    # training.py:2457-2465: the model is built on the GPU, then each unit's parameters give way to their chunks
    job = _job()
    params = stage_parameters(job, 0)[0]
    units = fsdp2_units(job, params)
    tl = predict_stage(job, 0).timeline
    embedding_chunks = 2 * units[1].shard_elements
    assert _rows(tl, INIT_MODULE) == [(2 * sum(p.numel for p in params) + embedding_chunks, 0, 1)]
    assert tl.phases[0].detail == "torch_fsdp2 model init" and tl.alive_at(0).tolist() == [tl.module.index(INIT_MODULE)]
    # --use-cpu-initialization: fully_shard moves one unit at a time to the GPU (the chunks so far, that unit, its own)
    cpu = predict_stage(_job("--use-cpu-initialization"), 0).timeline
    full = {u.name: 2 * sum(p.numel for p in u.params) for u in units}
    chunks = [2 * u.shard_elements for u in units[1:]]  # module order: embedding, layers, output (then the root)
    assert _rows(cpu, INIT_MODULE)[0][0] == max(sum(chunks[:k]) + full[u.name] + chunks[k]
                                                for k, u in enumerate(units[1:]))
    # a wide model of short sequences over 64 ranks: the whole model at initialisation is the rank's peak
    wide = FSDP2.replace("--world-size 4 --global-batch-size 16", "--world-size 64 --global-batch-size 128")
    wide = wide.replace("--num-layers 2 --hidden-size 64", "--num-layers 16 --hidden-size 2048")
    wide = wide.replace("--seq-length 128", "--seq-length 16")
    peak = predict_stage(parse_megatron_args(wide)[0], 0).timeline
    assert peak.peak_event == 0 and peak.peak_phase.detail == "torch_fsdp2 model init"


# torch's own FSDP2 on 4 CPU processes (gloo): the chunks, all-gather outputs, flat buffers and sharded gradients of
# a unit shaped like a layer whose rows do not divide by 4 (what remat.memory.torch_fsdp2 prices)
_REAL_FSDP2 = '''
import json, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

def run(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    seen = {"all_gather": [], "reduce_scatter": []}
    for name, key in (("foreach_all_gather", "all_gather"), ("foreach_reduce", "reduce_scatter")):
        def spy(*a, _f=getattr(group_mod, name), _k=key, **k):
            seen[_k].append(_f(*a, **k))
            return seen[_k][-1]
        setattr(group_mod, name, spy)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 130, dtype=torch.bfloat16), torch.nn.ReLU(),
                                torch.nn.Linear(130, 64, dtype=torch.bfloat16))
    fully_shard(layer, mesh=init_device_mesh("cpu", (4,)), reshard_after_forward=True)
    (group,) = layer._get_fsdp_state()._fsdp_param_groups
    layer(torch.randn(8, 64, dtype=torch.bfloat16)).float().sum().backward()
    if rank == 0:
        json.dump({"chunks": [fp._sharded_param_data.numel() for fp in group.fsdp_params],
                   "gathered": [t.numel() for fp in group.fsdp_params for t in fp.all_gather_outputs],
                   "flat": [r.all_gather_output.numel() for r in seen["all_gather"]],
                   "reduce_scatter_input": [r[0].numel() for r in seen["reduce_scatter"]],
                   "grad_storage": sorted({p.grad._local_tensor.untyped_storage().nbytes()
                                           for p in layer.parameters()}),
                   "grad_dtype": str(next(layer.parameters()).grad.dtype)}, open(out, "w"))
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), sys.argv[2]), nprocs=4)
'''


def test_chunks_and_buffers_are_torch_fsdp2s_own(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script, out = tmp_path / "real_fsdp2.py", tmp_path / "out.json"
    script.write_text(_REAL_FSDP2)
    subprocess.run([sys.executable, str(script), str(port), str(out)], check=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    real = json.loads(out.read_text())
    unit = fsdp2_units(_job(), [ParamInfo("layers.0.fc1.weight", 130 * 64, shape=(130, 64)),
                                ParamInfo("layers.0.fc1.bias", 130, shape=(130,)),
                                ParamInfo("layers.0.fc2.weight", 64 * 130, shape=(64, 130)),
                                ParamInfo("layers.0.fc2.bias", 64, shape=(64,))])[1]
    assert real["chunks"] == [padded_shard(p, 4) for p in unit.params] == [33 * 64, 33, 16 * 130, 16]
    assert sum(real["gathered"]) * 2 == unit.gathered_bytes(2)  # one shards x chunk tensor per parameter
    assert real["flat"] == [unit.flat_bytes(1)] * 2  # forward and backward, bf16 elements
    assert real["reduce_scatter_input"] == [unit.flat_bytes(1)]
    assert real["grad_storage"] == [2 * unit.shard_elements] and real["grad_dtype"] == "torch.bfloat16"


def test_the_root_units_flat_buffer_is_gathered_in_forward_and_backward() -> None:
    # with the local layers the output layer is the root's (no fully_shard of its own): its flat all-gather buffer
    # is made at the root's pre-forward and again at its pre-backward, like every unit's (_fsdp_param_group.py:417)
    job = _job("--transformer-impl local")
    units = {u.name: u for u in fsdp2_units(job, stage_parameters(job, 0)[0])}
    root = units["root"].flat_bytes(2)
    assert root >= 2 * 1024 * 64  # the padded vocab's output layer, at least
    tl = predict_stage(job, 0).timeline
    spans = [(ph.kind, s) for ph, s, _ in tl.phase_spans()]
    forward = {s for k, s in spans if k == "forward"}
    backward = {s for k, s in spans if k == "backward"}
    made = [a for n, a, _ in _rows(tl, ALL_GATHER_MODULE) if n == root]
    assert len(made) == 2 * 2 and len([a for a in made if a in forward]) == 2  # forward and backward, 2 microbatches
    assert all(a in forward | backward for a in made)
