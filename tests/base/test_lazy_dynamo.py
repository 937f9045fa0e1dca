"""The CLI's deferred torch._dynamo (remat.lazy_dynamo): tracing and measuring without the compiler give the same
bytes, nothing is imported inside a recorded step, and compiling still works (the real package loads then)."""

from __future__ import annotations

import json
import subprocess
import sys

from remat.lazy_dynamo import defer_dynamo

SCRIPT = r"""
import json, sys
from remat.lazy_dynamo import defer_dynamo
assert defer_dynamo()
import torch
from remat import apply
from remat.config import ModelConfig
from remat.memory import measure as measure_module
from remat.memory.predict import predict
from remat.models import build_model, sample_batch

config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
model = build_model(config)
apply(model, "full/uniform/1")
seen, before = [], set()
record, prepare = measure_module.record_step, measure_module.import_for_steps
def prepared():  # what is imported from here until the step is recorded: nothing
    prepare()
    before.update(sys.modules)
def watched(*args, **kwargs):
    out = record(*args, **kwargs)
    seen.extend(sorted(set(sys.modules) - before))
    return out
measure_module.record_step, measure_module.import_for_steps = watched, prepared
measured = measure_module.measure(model, sample_batch(config))
predicted = predict(config, "selective")
compiler_loaded = "torch._dynamo.convert_frame" in sys.modules
disabled = torch.compiler.disable(lambda x: x + 1)
before_load = disabled(torch.ones(2)).tolist()
compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.arange(3.0)).tolist()
print(json.dumps({"measured": measured.nbytes, "predicted": predicted.nbytes, "imported_in_step": seen,
                  "compiler_loaded": compiler_loaded, "disabled": before_load,
                  "after_load": disabled(torch.ones(2)).tolist(),
                  "compiled": compiled, "optimize": hasattr(sys.modules["torch._dynamo"], "optimize")}))
"""


def test_deferred_dynamo_traces_the_same_bytes_and_still_compiles():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    from remat import apply
    from remat.config import ModelConfig
    from remat.memory.measure import measure
    from remat.memory.predict import predict
    from remat.models import build_model, sample_batch

    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    model = build_model(config)
    apply(model, "full/uniform/1")
    assert got["measured"] == measure(model, sample_batch(config)).nbytes
    assert got["predicted"] == predict(config, "selective").nbytes
    assert got["imported_in_step"] == []
    assert got["compiler_loaded"] is False  # measuring and predicting never loaded the compiler
    assert got["disabled"] == got["after_load"] == [2.0, 2.0]
    assert got["compiled"] == [1.0, 3.0, 5.0] and got["optimize"] is True


def test_the_real_package_is_left_alone():
    import torch._dynamo  # noqa: F401  (the test process has the real one)

    assert defer_dynamo() is False
    assert type(sys.modules["torch._dynamo"]).__name__ == "module"
