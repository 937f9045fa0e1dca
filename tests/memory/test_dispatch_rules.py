"""The CLI's lookup of dispatch rules in one call (remat.memory.dispatch_rules): torch's C++ argument parser calls it
for every operator a Python dispatch mode sees, a registered rule still runs (and one registered after it is put in
place), an operator without one is dispatched to the mode as before, and a fake trace gives the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys

from remat.config import ModelConfig
from remat.memory.predict import predict

SCRIPT = r"""
import json
from remat.cli import console_imports
with console_imports():
    from remat.cli.commands import run
import torch
from torch._library import simple_registry
from remat.memory import dispatch_rules
from remat.config import ModelConfig
from remat.memory.predict import predict

installed = simple_registry.find_torch_dispatch_rule is dispatch_rules.find_torch_dispatch_rule
asked = []
class Counting(dict):  # the registry's entries, each lookup of an operator's counted
    def get(self, name, default=None):
        asked.append(name)
        return simple_registry.singleton._data.get(name, default)
dispatch_rules._ENTRIES = Counting()

@torch.library.custom_op("remat_test::copy", mutates_args=())
def copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()

class Seen(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return func(*args, **(kwargs or {}))

@torch.library.register_torch_dispatch("remat_test::copy", Seen)  # registered after the lookup is put in place
def _(mode, func, types, args, kwargs):
    return args[0] + 1

seen = []
with Seen():
    ruled = copy(torch.zeros(2)).tolist()
    plain = (torch.ones(2) * 3).tolist()
nbytes = predict(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16), "selective").nbytes
print(json.dumps({"installed": installed, "ruled": ruled, "plain": plain, "seen": seen, "asked": sorted(set(asked)),
                  "nbytes": nbytes}))
"""


def test_the_lookup_in_one_call_is_what_torch_asks_and_finds_the_same_rules():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["installed"] is True
    assert got["ruled"] == [1.0, 1.0]  # the registered rule ran instead of the mode's __torch_dispatch__
    assert got["plain"] == [3.0, 3.0] and got["seen"] == ["aten.zeros.default", "aten.ones.default", "aten.mul.Tensor"]
    # torch's parser asked this function (it reads the registry through _ENTRIES), for the fake trace's operators too
    assert "remat_test::copy" in got["asked"] and "aten::mul.Tensor" in got["asked"]
    assert "aten::native_layer_norm" in got["asked"] or "aten::native_layer_norm_backward" in got["asked"]
    assert got["nbytes"] == predict(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16),
                                    "selective").nbytes
