"""A rank under Megatron's TE CUDA graphs (NOTE [TE CUDA graphs] in remat.parallel.cuda_graphs): the capture before
the first step, the static buffers reused along the schedule, and steady steps whose graphed parts allocate
nothing."""

from __future__ import annotations

from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.cuda_graphs import graphed_layers, graphed_rows, split_graphed_rows, static_bytes, static_input_sets
from remat.parallel.job_predict import OPTIMIZER_STATE_MODULE, RESIDENT_PARTS, parts_at, predict_stage
from remat.parallel.schedule import max_in_flight, partition, rank_chunks, schedule_actions

MIB = 2**20
FLAGS = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
         "--micro-batch-size 2 --global-batch-size 8 --vocab-size 256 --bf16 --tensor-model-parallel-size 2 "
         "--sequence-parallel --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
         "--world-size 4 --use-distributed-optimizer --attention-backend unfused --transformer-impl "
         "transformer_engine --disable-bias-linear --swiglu --normalization RMSNorm --position-embedding-type rope")
GRAPHS = " --cuda-graph-impl transformer_engine --cuda-graph-modules attn --cuda-graph-warmup-steps 0"


def test_static_inputs_are_reused_once_their_backward_has_run():
    # cuda_graphs.py:2450-2563: a chunk's forward takes one set per graphed layer, reusing a set whose backward ran
    acts = schedule_actions("interleaved", 2, 4, 4, 1, runtime="megatron")  # the golden case's last rank
    assert max_in_flight(acts) == 7  # 6 warm-up forwards, then one more before the first backward
    assert static_input_sets(acts, {c: [(8, 64), (8, 64)] for c in (1, 3, 5, 7)}) == {(8, 64): 14}
    # a signature's sets serve only that signature: layers without the mask take their own
    sets = static_input_sets(acts, {c: [(8, 64), (8, 0)] for c in (1, 3, 5, 7)})
    assert sets == {(8, 64): 7, (8, 0): 7}
    # 1F1B on the first of 4 stages: 3 warm-ups, 4 forwards in flight; the last stage: one at a time
    assert static_input_sets(schedule_actions("1f1b", 4, 8, rank=0, runtime="megatron"), {0: [(1,)]}) == {(1,): 4}
    assert static_input_sets(schedule_actions("1f1b", 4, 8, rank=3, runtime="megatron"), {3: [(1,)] * 3}) == {(1,): 3}


def test_static_buffer_bytes_and_graphed_scopes():
    job = Job.from_megatron_args(FLAGS + GRAPHS)
    hidden, mask = static_bytes(job, 512)
    assert hidden == 128 // 2 * 2 * 64 * 2  # bf16 [s/tp, b, h] under sequence parallelism (module.py:257-272)
    assert mask == 2 * 128 * 128  # bool [b, 1, s, s] (transformer_layer.py:1226-1231)
    moe = ModelConfig(num_layers=4, num_moe_experts=4, moe_router_topk=1, moe_layer_freq=[0, 1, 1, 0])
    specs = partition(moe, 1)
    assert [(g.layer, g.attention, g.mlp) for g in graphed_layers(moe, ("mlp",), specs)[0]] == \
        [(0, False, True), (3, False, True)]  # mlp: the dense layers only (cuda_graphs.py:2170-2172)
    assert all(g.attention and g.mlp for g in graphed_layers(moe, (), specs)[0])  # no scope: whole layers


def test_a_graphed_rank_holds_the_static_buffers_and_its_steady_step_no_graphed_tensor():
    eager_job = Job.from_megatron_args(FLAGS)
    job = Job.from_megatron_args(FLAGS + GRAPHS)
    eager = predict_stage(eager_job, 1, device="cuda", kernels="te", gpu="h100")
    graphed = predict_stage(job, 1, device="cuda", kernels="te", gpu="h100")
    tl, info = graphed.timeline, graphed.timeline.meta["cuda_graphs"]
    n = info["capture_events"]
    assert n == eager.timeline.num_events and tl.num_events == 2 * n
    acts = schedule_actions("interleaved", 2, 4, 2, 1, runtime="megatron")
    assert info["static_input_sets"] == max_in_flight(acts) * 2  # 2 graphed layers per chunk
    hidden, mask = info["hidden_bytes"], info["mask_bytes"]
    # resident: the static inputs, one grad-output set, the last grad input, and four more torch cuBLAS workspaces
    # (TE's warm-up stream and the capture stream, each with the forward and autograd threads' handles)
    e = eager.timeline
    ends = [parts_at(t, t.num_events - 1) for t in (e, tl)]
    assert ends[1]["workspaces"] - ends[0]["workspaces"] == \
        info["static_input_sets"] * (hidden + mask) + 2 * hidden + 4 * 32 * MIB
    # the input gradients each chunk's last backward sends (held by the runtime) are graph outputs now: pool memory
    sent = [r for r in e.alive_at(e.num_events - 1) if e.phases[e.phase_index[r]].kind == "backward"]
    assert [e.nbytes[r] for r in sent] == [hidden, hidden]  # chunks 1 and 3
    assert ends[0]["activations"] - ends[1]["activations"] == 2 * hidden
    assert all(ends[0][p] == ends[1][p] for p in RESIDENT_PARTS if p not in ("workspaces", "activations"))
    # the steady step allocates nothing inside the graphs: no attention row after the capture
    steady = [r for r in range(len(tl.nbytes)) if tl.alloc_at[r] >= n]
    assert steady and not any(".self_attention" in tl.module[r] or ".input_layernorm" in tl.module[r]
                              for r in steady)
    assert any(".mlp" in tl.module[r] for r in steady)
    # the capture runs only the graphed parts: no MLP row is made in it, and Adam's moments come after it
    capture = [r for r in range(len(tl.nbytes)) if tl.alloc_at[r] < n and tl.free_at[r] != -1]
    assert capture and not any(".mlp" in tl.module[r] for r in capture)
    moments = [r for r in range(len(tl.nbytes)) if tl.module[r] == OPTIMIZER_STATE_MODULE]
    assert moments and all(tl.alloc_at[r] == n for r in moments)
    # torch's cuBLAS workspaces: TE's warm-up stream (forward and autograd threads) before the capture, the capture
    # stream's at its first forward and backward, the step's main stream's at its first torch GEMM
    first_forward, first_backward = (min(p.start for p in e.phases if p.kind == kind) for kind in ("forward",
                                                                                                   "backward"))
    made_at = sorted(tl.alloc_at[r] for r in range(len(tl.nbytes)) if tl.module[r] == "cuda.cublas_workspace")
    assert made_at == [0, 0, first_forward, first_backward, n, n]
    live = tl.live_bytes()
    added = ends[1]["workspaces"] - ends[0]["workspaces"]  # the static buffers and workspaces, all run long
    assert live[n:].max() - added < e.peak_bytes  # the graphed attention's tensors no longer count
    assert graphed.peak_bytes == max(live[:n].max(), live[n:].max())


def test_a_graphed_layers_input_dies_when_its_replay_returns():
    # graph.py:842-848: the replay copies its input into the static buffer and keeps no reference to it, so the
    # previous layer's output, which the eager attention kept for its backward, dies after the layer's forward
    job = Job.from_megatron_args(FLAGS + GRAPHS)
    e = predict_stage(Job.from_megatron_args(FLAGS), 1, device="cuda", kernels="te", gpu="h100").timeline
    specs = rank_chunks(partition(job.model.replace(tie_embeddings=False), 2, 2, empty_ends=True), 2, 1)
    graphed = {g.layer: g for chunk in graphed_layers(job.model, ("attn",), specs).values() for g in chunk}
    inside, early = graphed_rows(e, graphed)
    assert inside and early
    hidden = static_bytes(job, 512)[0]
    for row, free in early.items():
        was, now = e.phase_at(e.free_at[row]), e.phase_at(free)
        assert (was.kind, now.kind, was.region, was.detail) == ("backward", "forward", now.region, now.detail)
        assert row not in inside and e.alloc_at[row] < free < e.free_at[row]
    # the previous layer's output, one per (chunk, microbatch): the input of each chunk's second layer
    outputs = [r for r in early if e.phases[e.phase_index[r]].region.startswith("layer")]
    assert len(outputs) == 2 * 4 and all(e.nbytes[r] == hidden for r in outputs)
    # the rest are the rotary tables the chunk's forward made and only the graphed attention read (a graph takes
    # them as a static input, cuda_graphs.py:2404-2427)
    assert all(e.phases[e.phase_index[r]].region == "" for r in set(early) - set(outputs))


def test_without_pipelining_one_microbatch_is_captured_and_mlp_graphs_take_no_mask():
    # cuda_graphs.py:2598-2601: pp = 1 captures one microbatch (every microbatch replays it, module.py:321), so a
    # rank holds one set per graphed layer; an MLP graph's static input is the hidden state alone
    # (transformer_layer.py:1222: the mask only where the attention is graphed)
    flags = FLAGS.replace("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --world-size 4",
                          "--world-size 2")
    for scope, mask in ((" --cuda-graph-modules mlp", False), ("", True)):
        job = Job.from_megatron_args(flags + " --cuda-graph-impl transformer_engine --cuda-graph-warmup-steps 0"
                                     + scope)
        info = predict_stage(job, 0, device="cuda", kernels="te", gpu="h100").timeline.meta["cuda_graphs"]
        assert info["static_input_sets"] == 8 and info["graphed_layers"] == list(range(8))
        sets = info["static_bytes"] - 2 * info["hidden_bytes"]
        assert sets == 8 * (info["hidden_bytes"] + info["mask_bytes"] * mask)


MOE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
       "--micro-batch-size 2 --global-batch-size 8 --vocab-size 256 --bf16 --tensor-model-parallel-size 2 "
       "--sequence-parallel --pipeline-model-parallel-size 2 --world-size 4 --use-distributed-optimizer "
       "--transformer-impl transformer_engine --disable-bias-linear --swiglu --normalization RMSNorm "
       "--position-embedding-type rope --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
       "--moe-shared-expert-intermediate-size 64 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
       "--moe-layer-freq ([0]*1+[1]*3) --mtp-num-layers 1 --recompute-granularity selective "
       "--recompute-modules moe_act")
SCOPED = " --cuda-graph-impl transformer_engine --cuda-graph-modules [attn mlp moe_router moe_preprocess]"
ROUTER_PARTS = (".self_attention", ".input_layernorm", ".pre_mlp_layernorm", ".mlp.router", ".mlp.shared_experts")


def _routed(module: str) -> bool:
    return ".mlp.experts." in module and ".shared_experts" not in module


def test_moe_router_graphs_hold_attention_router_and_shared_experts_and_the_mtp_layer():
    # transformer_layer.py:1296-1306 and moe_layer.py:656-674: the graph runs the attention, the pre-MLP layernorm,
    # the shared experts, the router and the preprocess; dispatch, routed experts and combine run eagerly after the
    # replay (transformer_layer.py:1376-1428). cuda_graphs.py:2265-2270 graphs the MTP depth's layer too.
    eager = predict_stage(Job.from_megatron_args(MOE), 1, device="cuda", kernels="te", gpu="h100").timeline
    job = Job.from_megatron_args(MOE + SCOPED + " --cuda-graph-warmup-steps 0")
    tl = predict_stage(job, 1, device="cuda", kernels="te", gpu="h100").timeline
    info = tl.meta["cuda_graphs"]
    assert info["graphed_layers"] == [-1, 2, 3]  # the last stage: layers 2 and 3 (MoE) and the MTP depth's layer
    n = info["capture_events"]
    steady = [r for r in range(len(tl.nbytes)) if tl.alloc_at[r] >= n]
    assert not any(part in tl.module[r] for r in steady for part in ROUTER_PARTS)
    assert any(_routed(tl.module[r]) for r in steady)  # the routed experts run eagerly, in the layers and the MTP's
    assert any("mtp.0.mtp_model_layer.mlp.experts" in tl.module[r] for r in steady)
    assert any(tl.phases[tl.phase_index[r]].kind == "recompute" for r in steady)  # moe_act, outside the graphs
    capture = [r for r in range(len(tl.nbytes)) if tl.alloc_at[r] < n and tl.free_at[r] != -1]
    assert not any(_routed(tl.module[r]) for r in capture)
    for part in (".mlp.router", ".mlp.shared_experts", "mtp.0.mtp_model_layer.self_attention"):
        assert any(part in tl.module[r] for r in capture)
    # one grad-output set per output signature (graph.py:666-680): the permuted copies [tokens x topk, h] bf16 and
    # their fp32 probs, the shared experts' output and the residual [s/tp, b, h] bf16 (moe_utils.py:1550-1590)
    hidden = info["hidden_bytes"]
    tokens = 128 // 2 * 2
    assert info["grad_output_bytes"] == 2 * hidden + 4 * tokens * 2 + hidden + hidden
    sets = info["static_input_sets"]
    assert sets == 3 and info["static_bytes"] == sets * (hidden + info["mask_bytes"]) + info["grad_output_bytes"] \
        + hidden
    # the steady step keeps the model state, the static buffers; the input gradient the chunk's first layer sends
    # back is the graph's (pool memory), no longer counted
    ends = [parts_at(t, t.num_events - 1) for t in (eager, tl)]
    assert ends[1]["workspaces"] - ends[0]["workspaces"] == info["static_bytes"]
    assert ends[0]["activations"] - ends[1]["activations"] == hidden
    assert all(ends[0][p] == ends[1][p] for p in RESIDENT_PARTS if p not in ("workspaces", "activations"))
    assert tl.live_bytes()[n:].max() - info["static_bytes"] < eager.peak_bytes


def test_a_moe_router_graphs_backward_rows_and_its_input_die_with_the_graph():
    # autograd frees a node's saved tensors once it has run: a backward row belongs to the part whose forward row is
    # freed next (eager where the one freed last is the other part's); the layer input, kept by the graphed
    # attention only, dies when the replay returns, before the eager dispatch (graph.py:842-848)
    job = Job.from_megatron_args(MOE + SCOPED + " --cuda-graph-warmup-steps 0")
    e = predict_stage(Job.from_megatron_args(MOE), 1, device="cuda", kernels="te", gpu="h100").timeline
    specs = rank_chunks(partition(job.model.replace(tie_embeddings=False), 2, empty_ends=True), 2, 1)
    graphed = {g.layer: g for chunk in graphed_layers(job.model, job.cuda_graph_modules, specs).values()
               for g in chunk}
    assert graphed[3].router and not graphed[3].mlp and graphed[-1].router
    inside, early = split_graphed_rows(e, graphed)
    forward, dispatch, shared_rows = -1, [], 0
    for i, p in enumerate(e.phases):
        if p.region != "layer 3" or p.detail != "microbatch 0, chunk 1":
            continue
        rows = [r for r in range(len(e.nbytes)) if e.phase_index[r] == i]
        if p.kind == "forward":
            forward = i
            routed = [r for r in rows if _routed(e.module[r])]
            assert routed and not set(routed) & inside
            assert all(r in inside for r in rows if any(part in e.module[r] for part in ROUTER_PARTS))
            # the replay returns at the layer's first eager row: the dispatch, after the router, before the experts
            replay_end = min(e.alloc_at[r] for r in rows if r not in inside and ".mlp" in e.module[r])
            router = [e.alloc_at[r] for r in rows if ".mlp.router" in e.module[r]]
            assert max(router) < replay_end < min(e.alloc_at[r] for r in routed)
            freed_in = {r: e.phase_at(e.free_at[r]) for r in early}
            layer_input = [r for r, at in freed_in.items() if (at.region, at.detail) == (p.region, p.detail)
                           and e.phases[e.phase_index[r]].region == "layer 2"]
            assert [e.nbytes[r] for r in layer_input] == [static_bytes(job, 512)[0]]
            assert early[layer_input[0]] == replay_end - 1 < e.free_at[layer_input[0]]
        elif p.kind == "recompute":
            assert rows and not set(rows) & inside
        else:  # the backward: both the graph's rows and the eager experts' rows
            assert set(rows) & inside and set(rows) - inside
            # the shared experts' backward rows are the graph's; the rows of the nodes that saved nothing between
            # the routed experts' last saved tensor and the router's first (the dispatch's) are eager: counted
            saved = [r for r in range(len(e.nbytes)) if e.phase_index[r] == forward and p.start <= e.free_at[r]]
            last_routed = max((e.free_at[r] for r in saved if _routed(e.module[r])), default=-1)
            first_router = min((e.free_at[r] for r in saved if ".mlp.router" in e.module[r]), default=-1)
            dispatch += [r for r in rows if last_routed < e.alloc_at[r] < first_router]
            frees = [e.free_at[x] for x in saved if ".shared_experts" in e.module[x]]
            shared = [r for r in rows if frees and min(frees) < e.alloc_at[r] < max(frees)]
            assert set(shared) <= inside
            shared_rows += len(shared)
    assert dispatch and not set(dispatch) & inside and shared_rows


def test_warmup_steps_run_eager_steps_before_the_capture():
    # training.py:4632-4645: the capture comes after that many eager steps, so the peak since the process started is
    # at least an eager step's; from the second step on Adam's moments exist through the capture
    eager = predict_stage(Job.from_megatron_args(MOE), 1, device="cuda", kernels="te", gpu="h100").timeline
    at0 = predict_stage(Job.from_megatron_args(MOE + SCOPED + " --cuda-graph-warmup-steps 0"), 1, device="cuda",
                        kernels="te", gpu="h100")
    for warmup in (1, 3):
        r = predict_stage(Job.from_megatron_args(MOE + SCOPED + f" --cuda-graph-warmup-steps {warmup}"), 1,
                          device="cuda", kernels="te", gpu="h100")
        tl, info = r.timeline, r.timeline.meta["cuda_graphs"]
        n = info["capture_events"]
        assert n == eager.num_events and tl.num_events == 3 * n and info["capture_start"] == n
        live = tl.live_bytes()
        moments = [row for row in range(len(tl.nbytes)) if tl.module[row] == OPTIMIZER_STATE_MODULE]
        if warmup > 1:  # the warm-up step is a steady eager step
            assert (live[:n] == eager.live_bytes()).all()
            assert {tl.alloc_at[row] for row in moments} == {eager.alloc_at[row] for row in range(len(eager.nbytes))
                                                             if eager.module[row] == OPTIMIZER_STATE_MODULE}
        else:  # the first step: its optimizer step makes the moments, so it holds less before
            assert all(tl.alloc_at[row] == n - 1 for row in moments)
            assert live[:n].max() < eager.peak_bytes
        assert r.peak_bytes == max(live[:n].max(), live[n:].max())
        if warmup > 1:  # the capture (graphed parts only, the moments made) holds less than the eager step
            assert live[n:2 * n].max() < live[:n].max()
        # the same steady step and resident state as a capture before the first step
        ends = [parts_at(t.timeline, t.timeline.num_events - 1) for t in (at0, r)]
        assert ends[0] == ends[1]
        assert (live[2 * n:] == at0.timeline.live_bytes()[n:]).all()
