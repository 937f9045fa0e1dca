"""Tests for remat.policy: Megatron-LM recompute semantics, short form, flags, layer groups."""

import dataclasses
import itertools
import re

import pytest

from remat.policy import DEFAULT_SELECTIVE_MODULES, ENGINES, SELECTIVE_MODULES, Policy, PolicyError

MODULE_SUBSETS = [
    c for r in range(1, len(SELECTIVE_MODULES) + 1) for c in itertools.combinations(SELECTIVE_MODULES, r)
    if not ("non_matmul" in c and {"layernorm", "act", "moe_act"} & set(c))  # refused: non_matmul recomputes them
]


def _valid_policies() -> list[Policy]:
    out = []
    for engine in ENGINES:
        out.append(Policy(engine=engine))
        for k in (1, 2, 3, 7, 32):
            for dsa in (False, True):
                out.append(Policy("full", "uniform", k, engine=engine, distribute_saved_activations=dsa))
        for k in (0, 1, 4, 24):
            for dsa in (False, True):
                out.append(Policy("full", "block", k, engine=engine, distribute_saved_activations=dsa))
        for mods in MODULE_SUBSETS:
            out.append(Policy("selective", modules=mods, engine=engine))
    return out


VALID = _valid_policies()


# ------------------------------------------------------------------------ construction
def test_modules_normalised_sorted_and_deduplicated():
    p = Policy("selective", modules=["act", "core_attn", "mlp", "core_attn"])
    assert p.modules == ("core_attn", "mlp", "act")
    assert Policy("selective", modules=("MLP ", "Core_Attn")) == Policy("selective",
                                                                        modules=("core_attn", "mlp"))
    assert isinstance(p.modules, tuple)
    hash(p)  # frozen and hashable


def test_keywords_normalised():
    assert Policy("FULL", "Uniform", 2, engine="Non-Reentrant") == Policy("full", "uniform", 2,
                                                                          engine="non-reentrant")


def test_defaults_and_properties():
    p = Policy()
    assert p.is_none and not p.recomputes_layers and not p.is_selective
    assert Policy("full", "block", 2).recomputes_layers
    assert Policy("selective", modules=DEFAULT_SELECTIVE_MODULES).is_selective
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.granularity = "full"


# (kwargs, key phrase of the fix that the message must contain)
REFUSED = [
    (dict(granularity="full"), "add --recompute-method uniform or block"),
    (dict(granularity="full", num_layers=2), "add --recompute-method uniform or block"),
    (dict(granularity="full", method="uniform"), "add --recompute-num-layers K"),
    (dict(granularity="selective", modules=("core_attn",), method="uniform"),
     "drop --recompute-method/--recompute-num-layers"),
    (dict(granularity="selective", modules=("core_attn",), num_layers=1),
     "drop --recompute-method/--recompute-num-layers"),
    (dict(granularity="full", method="uniform", num_layers=1, modules=("mlp",)), "drop --recompute-modules"),
    (dict(granularity="none", modules=("mlp",)), "drop --recompute-modules"),
    (dict(granularity="selective", modules=("core_attn", "gdn")), "GatedDeltaNet layers, which remat's"),
    (dict(granularity="selective", modules=("mhc",)), "hyper-connection layers, which remat's"),
    (dict(granularity="selective", modules=("attention",)),
     "valid modules are core_attn, mlp, layernorm, act"),
    (dict(granularity="selective", modules=()), "add --recompute-modules core_attn"),
    (dict(granularity="selective"), "add --recompute-modules core_attn"),
    (dict(granularity="none", method="uniform"), "add --recompute-granularity full"),
    (dict(granularity="none", num_layers=2), "add --recompute-granularity full"),
    (dict(granularity="full", method="uniform", num_layers=0), "--recompute-num-layers >= 1"),
    (dict(granularity="full", method="uniform", num_layers=-3), "--recompute-num-layers >= 1"),
    (dict(granularity="full", method="block", num_layers=-1), "--recompute-num-layers >= 0"),
    (dict(granularity="full", method="block", num_layers=2.0), "must be an integer"),
    (dict(granularity="full", method="block", num_layers="2"), "must be an integer"),
    (dict(granularity="full", method="block", num_layers=True), "must be an integer"),
    (dict(granularity="partial"), "valid values are none, full, selective"),
    (dict(granularity="full", method="interleaved", num_layers=1), "valid values are uniform, block"),
    (dict(engine="sac"), "valid values are reentrant, non-reentrant"),
    (dict(distribute_saved_activations=True), "only applies to full granularity"),
    (dict(granularity="selective", modules=("core_attn",), distribute_saved_activations=True),
     "only applies to full granularity"),
    (dict(granularity="full", method="uniform", num_layers=1, distribute_saved_activations=1),
     "True or False"),
    (dict(granularity="selective", modules="core_attn"), "list or tuple"),
    (dict(granularity="selective", modules=True), "list or tuple"),
    (dict(granularity="selective", modules=(1,)), "must be strings"),
]


@pytest.mark.parametrize("kwargs,phrase", REFUSED)
def test_refused_combinations_explain_the_fix(kwargs, phrase):
    with pytest.raises(PolicyError) as info:
        Policy(**kwargs)
    assert phrase in str(info.value)
    assert isinstance(info.value, ValueError)


def test_full_needs_method_message_shows_remat_form():
    with pytest.raises(PolicyError, match=r"'full/uniform/K'"):
        Policy("full")


# ------------------------------------------------------------------------ short form
@pytest.mark.parametrize("policy", VALID, ids=str)
def test_parse_str_round_trip(policy):
    assert Policy.parse(str(policy)) == policy


def test_str_canonical_forms():
    assert str(Policy()) == "none"
    assert str(Policy("full", "uniform", 2)) == "full/uniform/2"
    assert str(Policy("full", "block", 4, distribute_saved_activations=True,
                      engine="non-reentrant")) == "full/block/4,distribute@non-reentrant"
    assert str(Policy("selective", modules=("mlp", "core_attn"))) == "selective/core_attn+mlp"
    assert str(Policy("selective", modules=("core_attn",), engine="non-reentrant")) == \
        "selective/core_attn@non-reentrant"


@pytest.mark.parametrize("text,expected", [
    ("none", Policy()),
    ("selective", Policy("selective", modules=("core_attn",))),
    ("  Selective / MLP + core_attn ", Policy("selective", modules=("core_attn", "mlp"))),
    ("FULL/Uniform/3", Policy("full", "uniform", 3)),
    ("full / block / 0 @ NON-REENTRANT", Policy("full", "block", 0, engine="non-reentrant")),
    ("full/uniform/1@reentrant", Policy("full", "uniform", 1)),
    ("full/uniform/1 , distribute", Policy("full", "uniform", 1, distribute_saved_activations=True)),
    ("none@non-reentrant", Policy(engine="non-reentrant")),
])
def test_parse_accepts(text, expected):
    assert Policy.parse(text) == expected


@pytest.mark.parametrize("text,phrase", [
    ("", "empty text"),
    ("full", "full/uniform/1"),
    ("full/uniform", "full/uniform/1"),
    ("full/diagonal/2", "full/uniform/1"),
    ("full/uniform/two", "not an integer"),
    ("full/uniform/1.5", "not an integer"),
    ("partial", "unknown granularity"),
    ("selective/core_attn/mlp", "too many"),
    ("selective/core_attn++mlp", "empty module"),
    ("full uniform 2", "whitespace"),
    ("full/uniform/2,fast", "unknown option"),
    ("full/uniform/2@a@b", "more than one"),
])
def test_parse_rejects_bad_text_with_grammar(text, phrase):
    with pytest.raises(PolicyError) as info:
        Policy.parse(text)
    msg = str(info.value)
    assert repr(text) in msg and phrase in msg
    assert "selective/core_attn+mlp" in msg and "@non-reentrant" in msg  # grammar with examples


@pytest.mark.parametrize("text,phrase", [
    ("full/uniform/0", ">= 1"),
    ("full/block/-2", ">= 0"),
    ("selective/gdn", "GatedDeltaNet layers"),
    ("selective/ffn", "valid modules are"),
    ("selective,distribute", "only applies to full"),
    ("full/uniform/1@sac", "non-reentrant"),
    ("full/uniform/1@", "non-reentrant"),
])
def test_parse_reports_invalid_policies(text, phrase):
    with pytest.raises(PolicyError) as info:
        Policy.parse(text)
    assert repr(text) in str(info.value) and phrase in str(info.value)


def test_parse_needs_a_string():
    with pytest.raises(PolicyError, match="string"):
        Policy.parse(3)


# Digits str.isdigit() (or the regex \d) accepts that are not 0-9: superscripts int() refuses, and other scripts'
# digits int() would read; a policy is written in 0-9.
NON_ASCII_DIGITS = ["\u00b2", "\u00b9\u00b2\u00b3", "\u0661\u0662\u0668", "\u096a", "\uff11\uff12"]


@pytest.mark.parametrize("digits", NON_ASCII_DIGITS)
def test_matmul_k_needs_digits_0_to_9(digits):
    text = f"selective/non_matmul+matmul_k{digits}"
    with pytest.raises(PolicyError, match=r"write matmul_k<N> with N >= 1 in digits 0-9") as info:
        Policy.parse(text)
    assert repr(text) in str(info.value)
    with pytest.raises(PolicyError, match="digits 0-9"):
        Policy("selective", modules=("non_matmul", f"matmul_k{digits}"))


@pytest.mark.parametrize("digits", NON_ASCII_DIGITS)
def test_layer_counts_need_digits_0_to_9(digits):
    with pytest.raises(PolicyError, match=r"layer count .* is not an integer \(digits 0-9\)"):
        Policy.parse(f"full/uniform/{digits}")
    with pytest.raises(PolicyError, match=r"--recompute-num-layers needs an integer \(digits 0-9\)"):
        Policy.from_megatron_args(["--recompute-granularity", "full", "--recompute-method", "uniform",
                                   "--recompute-num-layers", digits])


def test_counts_with_thousands_of_digits_are_refused():
    """int() refuses strings of more than 4300 digits with a ValueError of its own."""
    with pytest.raises(PolicyError, match="matmul_k<N>"):
        Policy.parse("selective/non_matmul+matmul_k" + "1" * 5000)
    with pytest.raises(PolicyError, match="layer count"):
        Policy.parse("full/uniform/" + "1" * 5000)
    assert Policy.parse("selective/non_matmul+matmul_k0128").modules == ("non_matmul", "matmul_k128")


# ------------------------------------------------------------------------ Megatron flags
LONG_COMMAND = """
torchrun --nproc_per_node 8 pretrain_gpt.py \\
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \\
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 \\
    --micro-batch-size 1 --global-batch-size 512 --lr 3e-4 --bf16 --use-flash-attn \\
    --recompute-granularity full --recompute-method=block --recompute-num-layers 3 \\
    --distribute-saved-activations --data-path /data/my-gpt_text_document \\
    --save /ckpt --load /ckpt --log-interval 10 --distributed-backend nccl
"""


@pytest.mark.parametrize("argv,expected", [
    ([], Policy()),
    (["--num-layers", "24", "--bf16"], Policy()),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     Policy("full", "uniform", 1)),
    (["--recompute-granularity=full", "--recompute-method=block", "--recompute-num-layers=4"],
     Policy("full", "block", 4)),
    (["--recompute-granularity", "selective"], Policy("selective", modules=("core_attn",))),
    (["--recompute-activations"], Policy("selective", modules=("core_attn",))),
    (["--recompute-activations", "--recompute-granularity", "selective"],
     Policy("selective", modules=("core_attn",))),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "core_attn", "layernorm",
      "--bf16"], Policy("selective", modules=("core_attn", "mlp", "layernorm"))),
    (["--recompute-modules", "mlp", "--recompute-activations"], Policy("selective", modules=("mlp",))),
    (["--recompute-granularity", "selective", "--recompute-modules=mlp"],
     Policy("selective", modules=("mlp",))),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
      "--recompute-modules", "mlp"], Policy("selective", modules=("mlp",))),  # argparse: last one wins
    (LONG_COMMAND, Policy("full", "block", 3, distribute_saved_activations=True)),
    ("--recompute-activations --recompute-modules core_attn mlp --seq-length 8192",
     Policy("selective", modules=("core_attn", "mlp"))),
])
def test_from_megatron_args(argv, expected):
    assert Policy.from_megatron_args(argv) == expected


def test_from_megatron_args_long_token_list():
    argv = LONG_COMMAND.replace("\\\n", " ").split()
    assert Policy.from_megatron_args(argv) == Policy("full", "block", 3, distribute_saved_activations=True)


@pytest.mark.parametrize("argv,phrase", [
    (["--recompute-granularity", "full", "--recompute-activations", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "drop one of them"),
    (["--recompute-method", "uniform", "--recompute-num-layers", "2"], "add --recompute-granularity full"),
    (["--recompute-num-layers", "2"], "add --recompute-granularity full"),
    (["--recompute-granularity", "full"], "add --recompute-method uniform or block"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "--recompute-num-layers K"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "drop --recompute-method/--recompute-num-layers"),
    (["--recompute-activations", "--recompute-num-layers", "1"],
     "drop --recompute-method/--recompute-num-layers"),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "gdn"], "GatedDeltaNet layers"),
    (["--recompute-granularity", "selective", "--recompute-modules=core_attn,mlp"], "separate modules"),
    (["--recompute-granularity", "selective", "--recompute-modules", "--bf16"], "at least one module"),
    (["--recompute-granularity", "partial"], "valid values are full, selective"),
    (["--recompute-granularity", "none"], "valid values are full, selective"),
    (["--recompute-granularity", "full", "--recompute-method", "blocks", "--recompute-num-layers", "1"],
     "valid values are uniform, block"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "x"],
     "needs an integer"),
    (["--recompute-granularity"], "needs a value"),
    (["--recompute-granularity", "--bf16"], "needs a value"),
    (["--recompute-layers", "3"], "unknown Megatron recompute flag"),
    (["--recompute-gran", "full"], "unknown Megatron recompute flag"),
    (["--recompute-activations=true"], "takes no value"),
    (["--distribute-saved-activations"], "only applies to full granularity"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--recompute-modules", "mlp"], "drop --recompute-modules"),
    (["--checkpoint-activations"], "--recompute-granularity full"),
])
def test_from_megatron_args_refusals(argv, phrase):
    with pytest.raises(PolicyError) as info:
        Policy.from_megatron_args(argv)
    assert phrase in str(info.value)


@pytest.mark.parametrize("argv,pattern", [
    ('--recompute-granularity "full', r"cannot split the Megatron command line .*No closing quotation; close the "
                                      r"quote .*or pass the flags as a list of tokens"),
    ("--recompute-granularity full\\", r"cannot split .*No escaped character"),
    (None, r"Megatron flags must be one string or a list of strings, got NoneType None: e\.g\. "
           r"'--recompute-granularity full"),
    (42, r"got int 42"),
    (b"--recompute-activations", r"got bytes"),
    (["--recompute-granularity", None], r"got list"),
    ({"--recompute-granularity": "full"}, r"got dict"),
])
def test_from_megatron_args_refuses_what_is_not_a_command_line(argv, pattern):
    with pytest.raises(PolicyError, match=pattern):
        Policy.from_megatron_args(argv)


def test_from_megatron_args_takes_any_sequence_of_tokens():
    tokens = ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2")
    assert Policy.from_megatron_args(tokens) == Policy.from_megatron_args(iter(tokens)) == Policy("full", "block", 2)


@pytest.mark.parametrize("policy", VALID, ids=str)
def test_to_megatron_args_round_trip(policy):
    if "non_matmul" in policy.modules:
        with pytest.raises(PolicyError, match="non_matmul.*no Megatron flag"):
            policy.to_megatron_args()
        return
    if "act" in policy.modules:
        with pytest.raises(PolicyError, match="use 'mlp'"):
            policy.to_megatron_args()
        return
    args = policy.to_megatron_args()
    assert all(isinstance(a, str) for a in args)
    assert Policy.from_megatron_args(args) == dataclasses.replace(policy, engine="reentrant")


def test_to_megatron_args_exact():
    assert Policy().to_megatron_args() == []
    assert Policy("full", "uniform", 2, distribute_saved_activations=True).to_megatron_args() == [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2",
        "--distribute-saved-activations"]
    assert Policy("selective", modules=("mlp", "core_attn")).to_megatron_args() == [
        "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"]
    # the engine is not a Megatron flag
    assert Policy("full", "block", 1, engine="non-reentrant").to_megatron_args() == \
        Policy("full", "block", 1).to_megatron_args()


def test_act_has_no_megatron_flag():
    with pytest.raises(PolicyError) as info:
        Policy("selective", modules=("core_attn", "act")).to_megatron_args()
    assert "no Megatron equivalent" in str(info.value) and "'mlp'" in str(info.value)


@pytest.mark.parametrize("modules, redundant", [("layernorm+non_matmul", "layernorm"),
                                                ("core_attn+act+non_matmul", "act"),
                                                ("layernorm+act+non_matmul", "layernorm+act")])
def test_non_matmul_refuses_what_it_already_recomputes(modules, redundant):
    with pytest.raises(PolicyError, match=f"non_matmul already recomputes .*: drop {re.escape(redundant)}$"):
        Policy.parse(f"selective/{modules}")


def test_non_matmul_round_trips_in_remat_form():
    for text in ("selective/non_matmul", "selective/core_attn+mlp+non_matmul@non-reentrant",
                 "selective/non_matmul+matmul_k128"):
        p = Policy.parse(text)
        assert str(p) == text and Policy.parse(str(p)) == p and "non_matmul" in p.selective_modules(0)
    assert Policy.parse("selective/matmul_k064+non_matmul").modules == ("non_matmul", "matmul_k64")


@pytest.mark.parametrize("text, phrase", [
    ("selective/matmul_k32", "add non_matmul"),
    ("selective/core_attn+matmul_k32", "add non_matmul"),
    ("selective/non_matmul+matmul_k0", "N >= 1"),
    ("selective/non_matmul+matmul_k", "N >= 1"),
    ("selective/non_matmul+matmul_k32+matmul_k64", "give one matmul_k<N>"),
])
def test_contraction_limit_refusals(text, phrase):
    with pytest.raises(PolicyError, match=re.escape(phrase)):
        Policy.parse(text)


# ------------------------------------------------------------------------ layer groups
@pytest.mark.parametrize("policy,depth,groups", [
    (Policy("full", "uniform", 4), 10, [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]),
    (Policy("full", "uniform", 4), 8, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    (Policy("full", "uniform", 1), 3, [(0,), (1,), (2,)]),
    (Policy("full", "uniform", 3), 3, [(0, 1, 2)]),
    (Policy("full", "uniform", 3), 7, [(0, 1, 2), (3, 4, 5), (6,)]),
    (Policy("full", "block", 3), 8, [(0,), (1,), (2,)]),
    (Policy("full", "block", 8), 8, [(i,) for i in range(8)]),
    (Policy("full", "block", 0), 8, []),
    (Policy(), 8, []),
    (Policy("selective", modules=("core_attn", "mlp")), 8, []),
])
def test_layer_groups(policy, depth, groups):
    assert policy.layer_groups(depth) == groups


@pytest.mark.parametrize("depth,k", [(d, k) for d in range(1, 13) for k in range(1, d + 1)])
def test_uniform_groups_partition_the_stack(depth, k):
    groups = Policy("full", "uniform", k).layer_groups(depth)
    assert [i for g in groups for i in g] == list(range(depth))
    assert all(len(g) == k for g in groups[:-1]) and 1 <= len(groups[-1]) <= k
    assert len(groups) == -(-depth // k)


@pytest.mark.parametrize("policy", [Policy("full", "uniform", 12), Policy("full", "block", 12)])
def test_layer_groups_k_larger_than_depth(policy):
    with pytest.raises(PolicyError) as info:
        policy.layer_groups(8)
    assert "num_layers=12" in str(info.value) and "has 8 layers" in str(info.value)
    assert "k <= 8" in str(info.value)


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_layer_groups_boundary_k_equals_depth_plus_one(method):
    assert Policy("full", method, 8).layer_groups(8)  # k == depth is fine
    with pytest.raises(PolicyError, match="use k <= 8"):
        Policy("full", method, 9).layer_groups(8)


@pytest.mark.parametrize("depth", [0, -1, 2.5, True, "8"])
def test_layer_groups_bad_depth(depth):
    with pytest.raises(PolicyError, match="depth >= 1"):
        Policy("full", "uniform", 1).layer_groups(depth)


def test_the_docstring_examples_hold():
    import doctest

    import remat.policy

    result = doctest.testmod(remat.policy, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


# ------------------------------------------------------------------------ fine-grained activation offloading
OFFLOADED = [
    Policy(offload_modules=("core_attn", "attn_proj")),
    Policy(offload_modules=("attn_norm",), min_offloaded_tensor_size=0),
    Policy("selective", modules=("core_attn",), offload_modules=("attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                                                 "mlp_norm", "expert_fc1", "moe_act")),
    Policy("selective", modules=("mlp", "layernorm"), offload_modules=("core_attn",), engine="non-reentrant",
           min_offloaded_tensor_size=4096),
    Policy("full", "block", 2, offload_modules=("mlp_norm",), distribute_saved_activations=True),
    Policy("selective", modules=("moe_act",), offload_modules=("expert_fc1", "moe_act")),
]


@pytest.mark.parametrize("policy", OFFLOADED, ids=str)
def test_offload_short_form_and_megatron_flags_round_trip(policy):
    assert Policy.parse(str(policy)) == policy
    twin = dataclasses.replace(policy, engine="reentrant")
    assert Policy.from_megatron_args(policy.to_megatron_args()) == twin
    assert Policy.from_megatron_args(" ".join(policy.to_megatron_args())) == twin
    assert not policy.is_none and policy.offloads


def test_offload_short_form_text():
    policy = Policy("selective", modules=("core_attn",), offload_modules=["moe_act", "core_attn", "attn_norm"],
                    min_offloaded_tensor_size=65536)
    assert policy.offload_modules == ("attn_norm", "core_attn", "moe_act")  # Megatron's order, deduplicated
    assert str(policy) == "selective/core_attn,offload:attn_norm+core_attn+moe_act,offload_min:65536"
    assert str(Policy(offload_modules=("attn_norm",))) == "none,offload:attn_norm"  # default min size not written
    assert Policy.parse(" NONE , Offload : Attn_Proj + core_attn , offload_min : 0 @ non-reentrant ") == Policy(
        offload_modules=("core_attn", "attn_proj"), min_offloaded_tensor_size=0, engine="non-reentrant")
    assert Policy.parse("full/block/1,offload:mlp_norm,distribute") == Policy(
        "full", "block", 1, distribute_saved_activations=True, offload_modules=("mlp_norm",))
    assert Policy().is_none and not Policy().offloads


def test_offload_megatron_flags_text():
    policy = Policy("selective", modules=("core_attn",), offload_modules=("attn_norm", "core_attn"),
                    min_offloaded_tensor_size=4096)
    assert policy.to_megatron_args() == [
        "--recompute-granularity", "selective", "--recompute-modules", "core_attn",
        "--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "core_attn",
        "--min-offloaded-tensor-size", "4096"]
    assert Policy(offload_modules=("qkv_linear",)).to_megatron_args() == [
        "--fine-grained-activation-offloading", "--offload-modules", "qkv_linear"]
    assert Policy.from_megatron_args("pretrain_gpt.py --bf16 --fine-grained-activation-offloading "
                                     "--offload-modules=moe_act --min-offloaded-tensor-size=8 --lr 1e-4") == Policy(
        offload_modules=("moe_act",), min_offloaded_tensor_size=8)


@pytest.mark.parametrize("argv,phrase", [
    ("--fine-grained-activation-offloading --offload-modules attn_proj", "attn_proj needs core_attn"),
    ("--fine-grained-activation-offloading --offload-modules core_attn mlp", "unknown offload module 'mlp'"),
    ("--fine-grained-activation-offloading --offload-modules core_attn,attn_proj", "separate modules with spaces"),
    ("--fine-grained-activation-offloading", "needs --offload-modules with at least one module"),
    ("--fine-grained-activation-offloading --offload-modules --bf16", "at least one module"),
    ("--offload-modules core_attn", "--offload-modules without --fine-grained-activation-offloading"),
    ("--min-offloaded-tensor-size 4", "add --fine-grained-activation-offloading, or drop"),
    ("--fine-grained-activation-offloading --offload-modules core_attn --cpu-offloading", "drop --cpu-offloading"),
    ("--fine-grained-activation-offloading --offload-modules core_attn --min-offloaded-tensor-size x",
     "--min-offloaded-tensor-size needs an integer >= 0"),
    ("--fine-grained-activation-offloading --offload-modules core_attn --min-offloaded-tensor-size", "needs a value"),
    ("--fine-grained-activation-offloading=1 --offload-modules core_attn", "takes no value"),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
     "--fine-grained-activation-offloading --offload-modules core_attn", "use full/block/K or selective"),
])
def test_offload_megatron_flag_refusals(argv, phrase):
    with pytest.raises(PolicyError) as info:
        Policy.from_megatron_args(argv)
    assert phrase in str(info.value)


@pytest.mark.parametrize("kwargs,phrase", [
    ({"offload_modules": ("attn_proj",)}, "add core_attn"),
    ({"offload_modules": ("layernorm",)}, "valid modules are attn_norm, qkv_linear, core_attn"),
    ({"offload_modules": "core_attn"}, "must be a list or tuple"),
    ({"offload_modules": ("core_attn",), "min_offloaded_tensor_size": -1}, "integer >= 0"),
    ({"offload_modules": ("core_attn",), "min_offloaded_tensor_size": 1.5}, "integer >= 0"),
    ({"min_offloaded_tensor_size": 7}, "has no effect without offload modules"),
    ({"granularity": "full", "method": "uniform", "num_layers": 2, "offload_modules": ("core_attn",)},
     "full/uniform checkpoints every layer"),
    ({"granularity": "selective", "modules": ("non_matmul",), "offload_modules": ("core_attn",)}, "drop non_matmul"),
    ({"granularity": "selective", "modules": ("core_attn",), "offload_modules": ("core_attn",),
      "engine": "non-reentrant"}, "use the reentrant engine"),
    ({"granularity": "selective", "modules": ("layernorm",), "offload_modules": ("mlp_norm",),
      "engine": "non-reentrant"}, "stop offloading mlp_norm"),
])
def test_offload_policy_refusals(kwargs, phrase):
    with pytest.raises(PolicyError) as info:
        Policy(**kwargs)
    assert phrase in str(info.value)


@pytest.mark.parametrize("text,phrase", [
    ("none,offload", "needs a value after ':'"),
    ("none,offload:", "needs a value after ':'"),
    ("none,offload:core_attn+", "empty offload module name"),
    ("none,offload:core_attn,offload:attn_norm", "given twice"),
    ("none,offload:core_attn,offload_min:1e6", "digits 0-9"),
    ("none,offload:core_attn,swap", "unknown option 'swap'"),
    ("full/block/1,distribute,distribute", "given twice"),
    ("none,offload:attn_proj", "needs core_attn"),
])
def test_offload_short_form_refusals(text, phrase):
    with pytest.raises(PolicyError) as info:
        Policy.parse(text)
    assert repr(text) in str(info.value) and phrase in str(info.value)
