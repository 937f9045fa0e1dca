"""remat.models.cross_entropy: each loss implementation holds the logits-sized tensors its source holds, computes
F.cross_entropy's loss and gradient, and is measured on CPU as it is predicted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from thread_ranks import Mailbox, ThreadTP, run_ranks
from torch import nn

from remat.config import CROSS_ENTROPY, ConfigError, ModelConfig
from remat.job import Job, JobError
from remat.megatron.compat import MegatronUnavailable, require_megatron_core
from remat.megatron.cpu_patches import megatron_on_cpu
from remat.megatron.world import ParallelSizes, megatron_world
from remat.memory.measure import measure
from remat.memory.predict import predict
from remat.models.cross_entropy import language_model_loss
from remat.models.gpt import build_model, sample_batch
from remat.models.tensor_parallel import SimulatedGroup
from remat.parallel.job_measure import format_rows, measure_job, rank_rows
from remat.timeline import Timeline

B, S, V = 2, 8, 96  # N = 16 tokens; V large enough that a logits-sized tensor is bigger than anything else
N = B * S
KINDS = ("megatron", "megatron_fused", "te")


class LossOnly(nn.Module):
    """Logits from an output layer of hidden size 1 into the loss: the only logits-sized tensors are the loss's
    (the logits, their copies and gradients); the weight and the hidden states are [V, 1] and [N, 1]."""

    def __init__(self, kind: str, vocab: int, dtype: torch.dtype, tp: int = 1):
        super().__init__()
        self.kind, self.group = kind, SimulatedGroup(tp) if tp > 1 else None
        self.hidden = nn.Parameter(torch.randn(B, S, 1, dtype=dtype))
        self.layers = nn.ModuleList([nn.Linear(1, vocab, bias=False, dtype=dtype)])  # the output layer

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.layers[0](self.hidden), labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return language_model_loss(logits, labels, self.kind, self.group)


def logits_sized(timeline: Timeline, elements: int) -> tuple[int, int, int]:
    """Bytes of the logits-sized rows (>= 2 bytes per logit): the most alive in forward, alive when forward ends
    (what backward needs), and the most alive in backward."""
    delta = np.zeros(timeline.num_events + 1, dtype=np.int64)
    for n, a, f in zip(timeline.nbytes, timeline.alloc_at, timeline.free_at):
        if n >= 2 * elements:
            delta[a] += n
            delta[f if f >= 0 else timeline.num_events] -= n
    live = np.cumsum(delta[:-1])
    end = timeline.forward_end
    return int(live[:end + 1].max()), int(live[end]), int(live[end + 1:].max())


def _step(kind: str, dtype: torch.dtype, tp: int = 1) -> tuple[Timeline, Timeline]:
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    real = measure(LossOnly(kind, V // tp, dtype, tp), (labels,))
    fake = predict(lambda: LossOnly(kind, V // tp, dtype, tp), batch=(labels,))
    return real, fake


# bytes per logit element (forward peak, saved for backward, backward peak), from the sources:
# megatron (tensor_parallel/cross_entropy.py): the logits + their fp32 copy (.float(), none for fp32 logits), which
#   becomes the softmax in place and is saved; backward makes it the gradient in place and returns it in fp32,
#   which autograd casts to the logits' dtype while the softmax is still saved.
# megatron_fused (fusions/fused_cross_entropy.py, under torch.compile): the same forward; backward copies the
#   softmax into a new fp32 buffer (inductor's functionalised index_put_) and writes the bf16 gradient from it
#   (4 + 4 + 2), bf16 whatever the logits' dtype: fp32 logits get it cast back to fp32 (4 + 2 + 4).
# te (TransformerEngine 2.17.1): the gradient is written into the logits in forward, saved and scaled in place.
# torch (F.cross_entropy(logits.float())): logits + fp32 copy (none for fp32) + log_softmax; backward the nll
#   gradient, the saved log_softmax and log_softmax's gradient (then its cast, once the nll gradient is gone).
PER_ELEMENT = {
    ("megatron", torch.bfloat16): (6, 4, 6), ("megatron", torch.float32): (4, 4, 4),
    ("megatron_fused", torch.bfloat16): (6, 4, 10), ("megatron_fused", torch.float32): (4, 4, 10),
    ("te", torch.bfloat16): (2, 2, 2), ("te", torch.float32): (4, 4, 4),
    ("torch", torch.bfloat16): (10, 4, 12), ("torch", torch.float32): (8, 4, 12),
}


@pytest.mark.parametrize("kind, dtype", list(PER_ELEMENT), ids=lambda x: str(x).replace("torch.", ""))
def test_logits_sized_bytes_follow_the_source(kind, dtype):
    real, fake = _step(kind, dtype)
    assert logits_sized(real, N * V) == tuple(b * N * V for b in PER_ELEMENT[kind, dtype])
    # and every other byte: the prediction is the measurement (CPU)
    assert real.nbytes == fake.nbytes and (real.live_bytes() == fake.live_bytes()).all()


@pytest.mark.parametrize("kind", KINDS)
def test_a_tensor_parallel_rank_holds_its_vocabulary_shard(kind):
    real, fake = _step(kind, torch.bfloat16, tp=2)
    assert logits_sized(real, N * V // 2) == tuple(b * N * V // 2 for b in PER_ELEMENT[kind, torch.bfloat16])
    assert real.nbytes == fake.nbytes and (real.live_bytes() == fake.live_bytes()).all()


def test_megatron_core_s_own_loss_allocates_the_same():
    # megatron-core's vocab_parallel_cross_entropy itself (0.16: the same statements as at d98e8a64) on a world of one
    try:
        require_megatron_core()
    except MegatronUnavailable as err:
        pytest.skip(str(err))
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    class Megatrons(LossOnly):
        def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits, labels).mean()

    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    with megatron_on_cpu(), megatron_world(ParallelSizes(), backend="gloo"):
        torch.manual_seed(0)
        theirs = measure(Megatrons("megatron", V, torch.bfloat16), (labels,))
    torch.manual_seed(0)
    mine = measure(LossOnly("megatron", V, torch.bfloat16), (labels,))
    # the same tensors, but for the scalars of `masked_target[target_mask] = 0` and `predicted_logits[...] = 0.0`,
    # which a CPU tensor's indexing makes on its device (8 and 4 bytes) and a CUDA tensor's on the CPU
    assert sorted(theirs.nbytes) == sorted(mine.nbytes + [8, 4])
    assert [n for n in theirs.nbytes if n > 8] == [n for n in mine.nbytes if n > 8]
    assert logits_sized(theirs, N * V) == logits_sized(mine, N * V)
    assert 0 <= theirs.peak_bytes - mine.peak_bytes <= 12


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("kind", CROSS_ENTROPY)
def test_loss_and_gradient_equal_f_cross_entropy(kind):
    logits = torch.randn(B, S, V, generator=torch.Generator().manual_seed(1)) * 4
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    want_loss, want_grad = _reference(logits, labels)
    mine = logits.clone().requires_grad_()
    loss = language_model_loss(mine * 1.0, labels, kind)  # * 1.0: the loss may write into its input
    loss.backward()
    # megatron_fused returns a bf16 gradient whatever the logits' dtype (as Megatron's does)
    tol = 4e-3 if kind == "megatron_fused" else 1e-6
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.grad, want_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_of_the_vocabulary_give_f_cross_entropy(kind):
    logits = torch.randn(B, S, V, generator=torch.Generator().manual_seed(3)) * 4
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
    want_loss, want_grad = _reference(logits, labels)
    box = Mailbox(2)

    def rank(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = logits[..., r * V // 2:(r + 1) * V // 2].clone().requires_grad_()
        loss = language_model_loss(shard * 1.0, labels, kind, ThreadTP(box, r))
        loss.backward()
        return loss.detach(), shard.grad

    (loss0, grad0), (loss1, grad1) = run_ranks(2, [box], rank)
    tol = 4e-3 if kind == "megatron_fused" else 1e-6
    torch.testing.assert_close(loss0, want_loss, rtol=1e-6, atol=1e-6)
    assert loss1 == loss0
    torch.testing.assert_close(torch.cat([grad0, grad1], dim=-1), want_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", CROSS_ENTROPY)
def test_the_reference_gpt_measures_as_predicted(kind):
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, micro_batch_size=2,
                         vocab_size=256, dtype="bf16", hidden_dropout=0.0, attention_dropout=0.0,
                         attention="sdpa", cross_entropy=kind)
    torch.manual_seed(0)
    real = measure(build_model(config, seed=0), sample_batch(config))
    fake = predict(config, "none")
    assert real.nbytes == fake.nbytes and (real.live_bytes() == fake.live_bytes()).all()


@pytest.mark.parametrize("kind, tp, pp", [("megatron_fused", 1, 2), ("te", 2, 2)])
def test_a_job_measures_as_predicted(kind, tp, pp):
    # the job path: plain stages at tp = 1 (LMHead), tensor-parallel ones (TPHead) at tp = 2, on gloo; Megatron's
    # unfused loss is measured by tests/parallel/test_job_measure.py (a Job's default)
    model = ModelConfig(num_layers=2, hidden_size=24, num_attention_heads=2, vocab_size=64, seq_length=16,
                        micro_batch_size=2, attention="sdpa", cross_entropy=kind)
    job = Job.build(model, precision="bf16", tp=tp, pp=pp, num_microbatches=2)
    rows = rank_rows(job, measure_job(job, timeout=60))
    for r in rows:
        assert r["measured_parts"] == r["predicted_parts"], format_rows(rows)
        assert r["measured_bytes"] == r["predicted_bytes"], format_rows(rows)


def test_the_default_is_torch_and_others_are_refused_by_name():
    assert ModelConfig().cross_entropy == "torch"
    with pytest.raises(ConfigError, match="cross_entropy"):
        ModelConfig(cross_entropy="apex")


FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
         "--vocab-size 1000 --bf16 ")


@pytest.mark.parametrize("flags, kind", [
    ("", "megatron"), ("--cross-entropy-loss-fusion", "megatron_fused"),
    ("--cross-entropy-loss-fusion --cross-entropy-fusion-impl native", "megatron_fused"),
    ("--cross-entropy-fusion-impl te", "megatron"),  # the impl counts only with the fusion
])
def test_megatron_flags_pick_megatron_s_loss(flags, kind):
    job = Job.from_megatron_args(FLAGS + flags)
    assert job.model.cross_entropy == kind
    assert Job.from_megatron_args(job.to_megatron_args()) == job


def test_te_fusion_is_refused_as_megatron_refuses_it():
    # megatron/training/arguments.py::validate_args asserts against it (TE's kernel is still modelled: a Job built
    # with cross_entropy='te', as megatron-core's TransformerConfig allows with a warning)
    with pytest.raises(JobError, match="stability"):
        Job.from_megatron_args(FLAGS + "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te")
    job = Job.build(ModelConfig(cross_entropy="te"), precision="bf16")
    assert job.model.cross_entropy == "te"
    with pytest.raises(JobError, match="stability"):
        job.to_megatron_args()


def test_a_job_computes_megatron_s_loss():
    # every Megatron rank runs Megatron's cross-entropy (tp = 1 included): a job's model never keeps 'torch'
    assert Job.build(ModelConfig(), precision="bf16").model.cross_entropy == "megatron"
