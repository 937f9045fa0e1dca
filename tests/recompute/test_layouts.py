"""Layer stacks people write themselves: a nanoGPT-style model (``transformer.h``, blocks called as ``block(x)``,
loss returned beside the logits) and a torchtitan-style model (layers in an ``nn.ModuleDict``, each called as
``layer(h, freqs_cis)``, logits returned and the loss computed outside). Each is found without ``layers=``; every
policy gives the plain model's gradients; measure and predict agree."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat.memory.measure import measure
from remat.memory.predict import predict
from remat.recompute.apply import apply, find_layer_stack
from remat.recompute.region import ApplyError

VOCAB, WIDTH, HEADS, SEQ, DEPTH = 96, 64, 4, 32, 4


# ------------------------------------------------------------------------ nanoGPT (karpathy/nanoGPT model.py)
class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.resid_dropout = nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.ln_1 = LayerNorm(WIDTH, bias=True)
        self.attn = CausalSelfAttention(dropout)
        self.ln_2 = LayerNorm(WIDTH, bias=True)
        self.mlp = MLP(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, WIDTH), wpe=nn.Embedding(SEQ, WIDTH), drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(dropout) for _ in range(DEPTH)]), ln_f=LayerNorm(WIDTH, bias=True)))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def nanogpt_loss(output, batch):
    return output[1]


# ------------------------------------------------------------------------ torchtitan (llama3 model, simplified)
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class ScaledDotProductAttention(nn.Module):
    """torchtitan wraps the attention kernel in a module (``attention.sdpa``): remat's ``core_attn`` for it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, n_kv_heads: int = 2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, n_kv_heads, WIDTH // HEADS
        self.wq = nn.Linear(WIDTH, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(WIDTH, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(WIDTH, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, WIDTH, bias=False)
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        rep = self.n_heads // self.n_kv_heads
        xk, xv = (torch.repeat_interleave(z, rep, dim=2) for z in (xk, xv))  # torchtitan's repeat_kv
        out = self.sdpa(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2))
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int = 160):
        super().__init__()
        self.w1 = nn.Linear(WIDTH, hidden, bias=False)
        self.w2 = nn.Linear(hidden, WIDTH, bias=False)
        self.w3 = nn.Linear(WIDTH, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = nn.RMSNorm(WIDTH, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(WIDTH, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Titan(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("freqs_cis", precompute_freqs_cis(WIDTH // HEADS, SEQ * 2), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(DEPTH)})
        self.norm = nn.RMSNorm(WIDTH, eps=1e-5)
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h)).float()


def titan_loss(output: torch.Tensor, batch) -> torch.Tensor:
    """torchtitan computes the loss outside the model; here next-token prediction on the batch's own tokens."""
    tokens = batch[0]
    return F.cross_entropy(output[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


# ------------------------------------------------------------------------ harness
LAYOUTS = {
    # name: (model class, stack path, loss_fn, batch maker, selective module -> targets in layer 0 (None: refused))
    "nanogpt": (NanoGPT, "transformer.h", nanogpt_loss,
                {"core_attn": None, "mlp": ["mlp"], "layernorm": ["ln_1", "ln_2"], "act": ["mlp.gelu"]}),
    "torchtitan": (Titan, "layers", titan_loss,
                   {"core_attn": ["attention.sdpa"], "mlp": ["feed_forward"],
                    "layernorm": ["attention_norm", "ffn_norm"], "act": None}),
}


def batch(layout: str):
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return (x, y) if layout == "nanogpt" else (x,)


def build(layout: str) -> nn.Module:
    torch.manual_seed(0)
    return LAYOUTS[layout][0]().train()


def step(model: nn.Module, layout: str, seed: int = 11):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    b = batch(layout)
    loss = LAYOUTS[layout][2](model(*b), b)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, torch.get_rng_state()


@functools.cache
def plain_step(layout: str):
    return step(build(layout), layout)


def supported(layout: str, policy: str) -> bool:
    modules = policy.split("@")[0].split("/", 1)[1].split("+") if policy.startswith("selective/") else []
    return all(LAYOUTS[layout][3][m] is not None for m in modules)


# ------------------------------------------------------------------------ tests
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stack_is_found_without_layers(layout):
    model = build(layout)
    path, layers = find_layer_stack(model)
    container = model.get_submodule(LAYOUTS[layout][1])
    assert path == LAYOUTS[layout][1]
    assert layers == (list(container.values()) if isinstance(container, nn.ModuleDict) else list(container))
    assert apply(model, "full/uniform/2").stack_path == path


def test_nanogpt_dropout_is_on():
    assert not torch.equal(plain_step("nanogpt")[0], step(build("nanogpt"), "nanogpt", seed=12)[0])


POLICIES = ["full/uniform/1", "full/uniform/2", "full/uniform/3", "full/uniform/4", "full/block/2",
            "selective/core_attn", "selective/mlp", "selective/layernorm", "selective/act",
            "selective/mlp+layernorm", "selective/core_attn+mlp"]


@pytest.mark.parametrize("engine", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_equal_the_plain_model(layout, policy, engine, recorder):
    if not supported(layout, policy):
        pytest.skip(f"{layout} has no such submodule (test_missing_submodules_are_named)")
    model = build(layout)
    state = apply(model, f"{policy}@{engine}")
    want = plain_step(layout)
    got = step(model, layout)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    # nn.RMSNorm's CPU kernel is composite: a reentrant region around the norm alone sums its input's gradient in
    # another order (tests/test_apply.py): last-bit differences. Everything else is bit for bit.
    exact = not (layout == "torchtitan" and engine == "reentrant" and "layernorm" in policy)
    for name, grad in want[1].items():
        if exact:
            assert torch.equal(got[1][name], grad), name
        else:
            torch.testing.assert_close(got[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert {id(r) for r in state.regions} == {id(r) for r in recorder.recomputed}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_selective_targets(layout):
    for module, targets in LAYOUTS[layout][3].items():
        if targets is None:
            continue
        state = apply(build(layout), f"selective/{module}")
        prefix = LAYOUTS[layout][1] + ".0."
        assert [r.names[0][len(prefix):] for r in state.regions if r.names[0].startswith(prefix)] == targets


@pytest.mark.parametrize("layout, module", [("nanogpt", "core_attn"), ("torchtitan", "act")])
def test_missing_submodules_are_named(layout, module):
    """nanoGPT calls the attention kernel inline; torchtitan calls F.silu inline: nothing to checkpoint alone."""
    with pytest.raises(ApplyError, match=f"selective module '{module}'.*its submodules are"):
        apply(build(layout), f"selective/{module}")


MEASURED = ["none", "full/uniform/1", "full/uniform/4", "full/block/2", "selective/mlp",
            "selective/core_attn@non-reentrant", "selective/layernorm+act"]


@pytest.mark.parametrize("policy", MEASURED)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_measure_and_predict_agree(layout, policy):
    if not supported(layout, policy):
        pytest.skip("no such submodule")
    model = build(layout)
    apply(model, policy)
    loss_fn = LAYOUTS[layout][2]
    torch.manual_seed(0)
    measured = measure(model, batch(layout), loss_fn=loss_fn)
    predicted = predict(lambda: build(layout), policy, batch=batch(layout), loss_fn=loss_fn)
    assert measured.peak_bytes == predicted.peak_bytes
    assert measured.meta["num_layers"] == predicted.meta["num_layers"] == DEPTH
    assert measured.peak_bytes > 0 and (policy == "none") == (not any(p.kind == "recompute"
                                                                          for p in measured.phases))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_recompute_keeps_only_the_layer_inputs(layout):
    """With one layer per group, a layer's forward keeps nothing: only the group inputs stay until backward."""
    plain = measure(build(layout), batch(layout), loss_fn=LAYOUTS[layout][2])
    model = build(layout)
    apply(model, "full/uniform/1")
    full = measure(model, batch(layout), loss_fn=LAYOUTS[layout][2])
    end = next(p.start for p in full.phases if p.kind == "backward") - 1
    at_end = full.breakdown(end)
    hidden = 2 * SEQ * WIDTH * 4
    kept_by_layers = [full.nbytes[r] for r in full.alive_at(end)
                      if full.phases[full.phase_index[r]].region.startswith("layer ")
                      and full.category[r] == "saved_activations"]
    assert kept_by_layers == [hidden]  # the last layer's output only: the final norm's input, kept by the head
    # nanoGPT keeps each layer's hidden input; torchtitan also its freqs_cis input (one shared buffer)
    assert at_end["group_inputs"] >= DEPTH * hidden - hidden  # layer 0's input is the embedding output
    assert full.peak_bytes < plain.peak_bytes
    assert math.isfinite(full.meta["loss"])
