"""The CLI's deferred torch parts (remat.lazy_torch). torch._dynamo: tracing and measuring without the compiler give
the same bytes, nothing is imported inside a recorded step, remat's own models import no torch._dynamo.source at all
(their batches are made fake, nothing is converted), and compiling still works (the real package loads then). The
packages no command reads: stand-ins bound where torch binds them, none run by a job's prediction, each run on its
first attribute read or submodule import."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from remat.config import ModelConfig
from remat.job import Job
from remat.lazy_torch import NAME, UNUSED, defer
from remat.parallel.job_predict import predict_job

SCRIPT = r"""
import json, sys
from remat.lazy_torch import NAME, defer
assert defer([NAME]) == [NAME]
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
enter, leave = measure_module.StepRecorder.__enter__, measure_module.StepRecorder.__exit__
def entered(self):  # what any recorder (a step's, a pipeline chunk's) imports from here to its exit: nothing
    out = enter(self)
    before.clear()
    before.update(sys.modules)
    return out
def left(self, *exc):
    seen.extend(sorted(set(sys.modules) - before))
    return leave(self, *exc)
measure_module.StepRecorder.__enter__, measure_module.StepRecorder.__exit__ = entered, left
measured = measure_module.measure(model, sample_batch(config))
predicted = predict(config, "selective")
from remat.job import Job
from remat.parallel.job_predict import predict_job
job = Job.build(config, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2)
job_peak = predict_job(job).worst.peak_bytes
own_source = "torch._dynamo.source" in sys.modules

class Doubled(torch.nn.Module):  # the user's code (__main__): torch.tensor under the fake mode converts a real tensor
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    def forward(self, x):
        for layer in self.layers:
            x = layer(x) * torch.tensor(2.0)
        return x.sum()
foreign = predict(Doubled, "full/uniform/1@non-reentrant", batch=lambda: (torch.ones(3, 4),))
foreign_source = "torch._dynamo.source" in sys.modules
compiler_loaded = "torch._dynamo.convert_frame" in sys.modules
disabled = torch.compiler.disable(lambda x: x + 1)
before_load = disabled(torch.ones(2)).tolist()
def plus_two(x):
    return x + 2
inside = torch._disable_dynamo(plus_two)  # torch's own: every dispatch mode's __torch_dispatch__ goes through it
inside_before = [inside(1), vars(plus_two).get("__dynamo_disable") is plus_two]  # fn itself, cached on fn
compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.arange(3.0)).tolist()
print(json.dumps({"measured": measured.nbytes, "predicted": predicted.nbytes, "imported_in_step": seen,
                  "own_source": own_source, "job": job_peak, "foreign": foreign.nbytes,
                  "foreign_source": foreign_source,
                  "compiler_loaded": compiler_loaded, "disabled": before_load,
                  "after_load": disabled(torch.ones(2)).tolist(),
                  "compiled": compiled, "optimize": hasattr(sys.modules["torch._dynamo"], "optimize"),
                  "inside": [*inside_before, inside(1),  # once loaded: the real disabled fn, asked for again
                             getattr(vars(plus_two).get("__dynamo_disable"), "_torchdynamo_disable", False)]}))
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
    assert got["imported_in_step"] == []  # the user's model too: torch._dynamo.source was imported before its step
    assert got["own_source"] is False and got["foreign_source"] is True
    job = Job.build(config, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2)
    assert got["job"] == predict_job(job).worst.peak_bytes
    assert got["foreign"] == predict(Doubled, "full/uniform/1@non-reentrant", batch=lambda: (torch.ones(3, 4),)).nbytes
    assert got["compiler_loaded"] is False  # measuring and predicting never loaded the compiler
    assert got["disabled"] == got["after_load"] == [2.0, 2.0]
    assert got["compiled"] == [1.0, 3.0, 5.0] and got["optimize"] is True
    assert got["inside"] == [3, True, 3, True]


class Doubled(torch.nn.Module):  # as SCRIPT's
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * torch.tensor(2.0)
        return x.sum()


def test_the_real_package_is_left_alone():
    import torch._dynamo  # noqa: F401  (the test process has the real one)

    assert defer([NAME]) == []
    assert type(sys.modules["torch._dynamo"]).__name__ == "module"


UNUSED_SCRIPT = r"""
import json, sys
from remat.lazy_torch import UNUSED, defer_torch, pending
deferred = defer_torch()
import torch
from remat.config import ModelConfig
from remat.job import Job
from remat.parallel.job_predict import predict_job

stand_ins = {name: type(sys.modules[name]).__name__ for name in UNUSED}
bound = [torch.nn.intrinsic is sys.modules["torch.nn.intrinsic"],
         torch.distributions is sys.modules["torch.distributions"], torch.utils.data is sys.modules["torch.utils.data"]]
config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
job = Job.build(config, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4, dp=2)
job_peak = predict_job(job).worst.peak_bytes
still = pending()
inside = sorted(m for m in sys.modules if m.startswith(tuple(name + "." for name in UNUSED)))
torch.manual_seed(0)
sample = torch.distributions.Normal(torch.zeros(3), torch.ones(3)).sample().tolist()  # an attribute: the package runs
from torch.masked.maskedtensor.core import is_masked_tensor  # a submodule of a package not run yet: it runs first
masked = [is_masked_tensor(torch.ones(1)),
          is_masked_tensor(torch.masked.as_masked_tensor(torch.ones(2), torch.ones(2) > 0))]
from torch.profiler import ProfilerActivity
quantized = torch.nn.quantized.Quantize.__module__
batches = [b.tolist() for b in torch.utils.data.DataLoader(list(range(5)), batch_size=2)]
print(json.dumps({"deferred": deferred, "stand_ins": stand_ins, "bound": bound, "inside": inside,
                  "job": job_peak, "not_run_after_a_job": still, "sample": sample, "masked": masked,
                  "activity": ProfilerActivity.CPU.name, "quantized": quantized,
                  "batches": batches, "missing": hasattr(torch.distributions, "no_such_name"),
                  "pending_at_the_end": pending()}))
"""


def test_deferred_unused_packages_load_on_first_use_and_a_job_reads_none():
    out = subprocess.run([sys.executable, "-c", UNUSED_SCRIPT], capture_output=True, text=True, timeout=300,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["deferred"] == [NAME, *UNUSED]
    # stand-ins, each bound to its parent as an import binds a module
    assert set(got["stand_ins"].values()) == {"_Deferred"} and got["bound"] == [True, True, True]
    # a whole job's prediction reads none of them: their __init__ has not run, none of their submodules is imported
    assert set(got["not_run_after_a_job"]) == {NAME, *UNUSED} and got["inside"] == []
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    assert got["job"] == predict_job(Job.build(config, precision="bf16", tp=2, sp=True, pp=2, num_microbatches=4,
                                               dp=2)).worst.peak_bytes
    torch.manual_seed(0)
    assert got["sample"] == torch.distributions.Normal(torch.zeros(3), torch.ones(3)).sample().tolist()
    assert got["masked"] == [False, True] and got["activity"] == "CPU" and got["missing"] is False
    assert got["quantized"] == torch.nn.quantized.Quantize.__module__
    assert got["batches"] == [[0, 1], [2, 3], [4]]
    # each ran when first read (distributions, masked, profiler, nn.quantized, utils.data), the others not yet
    assert set(got["pending_at_the_end"]) == {NAME, "torch.quantization", "torch.nn.intrinsic", "torch.nn.qat",
                                              "torch.nn.quantizable"}
