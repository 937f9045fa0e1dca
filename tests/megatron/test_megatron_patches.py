"""The CPU / fake-tensor workarounds for megatron-core: each test first shows megatron-core still misbehaving
without the workaround (so it fails, and the workaround can go, when megatron-core changes), then the fix."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.megatron.compat import MegatronUnavailable, require_megatron_core

try:
    require_megatron_core()
except MegatronUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import random as mrandom  # noqa: E402

from remat.megatron.cpu_patches import WORKAROUNDS, megatron_on_cpu, patched_attributes  # noqa: E402
from remat.megatron.world import ParallelSizes, megatron_world  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks megatron-core on a CPU-only torch build")
MISSING = object()


def snapshot():
    return [(owner.__dict__.get(name, MISSING) if isinstance(owner, type) else getattr(owner, name, MISSING))
            for owner, name in patched_attributes()]


def test_every_workaround_names_its_test():
    names = {name for name, _ in inspect.getmembers(__import__(__name__), inspect.isfunction)}
    assert {w.test for w in WORKAROUNDS} <= names


def test_patch_context_restores_everything():
    before, rng = snapshot(), torch.get_rng_state()
    with megatron_on_cpu():
        during = snapshot()
        torch.manual_seed(7)
    assert all(a is b for a, b in zip(before, snapshot()))
    assert any(a is not b for a, b in zip(before, during))
    assert torch.equal(rng, torch.get_rng_state())
    with pytest.raises(KeyError), megatron_on_cpu():  # undone when the body raises too
        raise KeyError("boom")
    assert all(a is b for a, b in zip(before, snapshot()))
    assert not hasattr(__import__("megatron.core.transformer.moe.moe_utils", fromlist=["x"]), "te_general_gemm")


def test_global_memory_buffer_needs_a_device():
    from megatron.core.utils import GlobalMemoryBuffer

    with pytest.raises((RuntimeError, AssertionError)):
        GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
    with megatron_on_cpu():
        assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x").device.type == "cpu"


def test_global_memory_buffer_keeps_tensors():
    from megatron.core.utils import GlobalMemoryBuffer

    with megatron_on_cpu():
        buffer = GlobalMemoryBuffer()  # megatron-core reuses one tensor per name: it outlives a fake trace
        first = buffer.get_tensor((4,), torch.float32, "n")
        assert buffer.get_tensor((2,), torch.float32, "n").untyped_storage() is first.untyped_storage()
        with megatron_world(ParallelSizes(), 0):
            made = parallel_state.get_global_memory_buffer()
        with megatron_world(ParallelSizes(), 0):
            assert parallel_state.get_global_memory_buffer() is not made
    assert parallel_state._GLOBAL_MEMORY_BUFFER is None


def test_rng_tracker_add_needs_cuda():
    with pytest.raises((RuntimeError, AssertionError)):
        mrandom.CudaRNGStatesTracker().add("x", 1)
    with megatron_on_cpu():
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.add("x", 1)
        torch.manual_seed(1)
        assert torch.equal(tracker.get_states()["x"], torch.get_rng_state())


def test_get_cuda_rng_state_needs_cuda():
    with pytest.raises((RuntimeError, AssertionError)):
        mrandom._get_cuda_rng_state()
    with megatron_on_cpu():
        assert torch.equal(mrandom._get_cuda_rng_state(), torch.get_rng_state())


def test_set_cuda_rng_state_is_silently_skipped():
    state = torch.get_rng_state()
    torch.rand(3)
    mrandom._set_cuda_rng_state(state)  # no error, and no effect: torch.cuda._lazy_call never runs it
    assert not torch.equal(torch.get_rng_state(), state)
    with megatron_on_cpu():
        expected = torch.rand(3)
        mrandom._set_cuda_rng_state(state)
        torch.set_rng_state(state)
        again = torch.rand(3)
        mrandom._set_cuda_rng_state(state)
        assert torch.equal(torch.rand(3), again) and expected.shape == again.shape


def test_rng_fork_fails_under_fake_tensors():
    original = mrandom.CudaRNGStatesTracker.__dict__["fork"]
    with megatron_on_cpu():
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 5)
        with FakeTensorMode(), pytest.raises(Exception, match="FakeTensor|fake"):
            with original(tracker, "model-parallel-rng"):
                pass
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 5)
        torch.manual_seed(0)  # the failed fork above left the tracker's state in the generator
        outside = torch.get_rng_state()
        with FakeTensorMode(), tracker.fork():
            inside = torch.get_rng_state()
        assert not torch.equal(inside, outside) and torch.equal(torch.get_rng_state(), outside)


def test_checkpoint_without_output_fp8_flag():
    assert mrandom.CheckpointWithoutOutput(fp8=False).fp8 is True  # megatron-core: fp8 = (fp8 is not None)
    with megatron_on_cpu():
        assert mrandom.CheckpointWithoutOutput(fp8=False).fp8 is False
        assert mrandom.CheckpointWithoutOutput().fp8 is False


def test_default_causal_mask_is_on_cuda():
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    with pytest.raises((RuntimeError, AssertionError)):
        utils.get_default_causal_mask(4)
    with megatron_on_cpu():
        expected = torch.triu(torch.ones(4, 4), diagonal=1).bool()
        assert torch.equal(utils.get_default_causal_mask(4), expected)
        assert torch.equal(fused_softmax.get_default_causal_mask(4), expected)


def test_moe_router_reads_undefined_te_gemm():
    from megatron.core.transformer.moe import moe_utils

    inputs, weight = torch.randn(2, 4), torch.randn(3, 4)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(inputs, weight, None, torch.float32)
    with megatron_on_cpu():
        out = moe_utils.router_gating_linear(inputs, weight, None, torch.float32)
    assert torch.allclose(out, inputs @ weight.T)


def test_mla_believes_te_is_installed():
    from megatron.core.transformer import multi_latent_attention

    with pytest.raises(ImportError):
        import transformer_engine  # noqa: F401
    assert multi_latent_attention.HAVE_TE is True
    with megatron_on_cpu():
        assert multi_latent_attention.HAVE_TE is False


def test_local_attention_refuses_k_channels():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    assert "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters
    with megatron_on_cpu():
        assert "k_channels" in inspect.signature(DotProductAttention.__init__).parameters


def test_fake_tensor_cache_keeps_a_copied_storage_alive():
    # remat.megatron.recorder runs aten.set_.source_Storage with FakeTensorMode's dispatch cache off: torch puts the
    # storage object in that op's cache key and keeps it for good (CheckpointWithoutOutput's refill never frees)
    import gc
    import weakref

    from remat.megatron.recorder import STORAGE_SETTERS, MegatronStepRecorder

    def freed_after_copy(recorded):
        freed = []
        with FakeTensorMode():
            x = torch.randn(4)
            y, z = x * 2, x * 3
            weakref.finalize(y.untyped_storage(), freed.append, True)
            if recorded:
                with MegatronStepRecorder(torch.nn.Linear(1, 1), []):
                    y.untyped_storage().copy_(z.untyped_storage())
            else:
                y.untyped_storage().copy_(z.untyped_storage())
            del y
            gc.collect()
        return freed == [True]

    assert torch.ops.aten.set_.source_Storage in STORAGE_SETTERS
    assert not freed_after_copy(recorded=False)  # torch's behaviour: the storage outlives every reference
    assert freed_after_copy(recorded=True)


def test_a_real_world_of_one_frees_collective_tensors_when_python_drops_them():
    # NOTE [a world of one process]: gloo's work kept an all-reduced tensor alive after Python dropped it, so its
    # free could land after the step's peak; in-process collectives hold nothing and give gloo's results
    import threading
    import weakref

    import torch.distributed as dist

    freed = []
    with megatron_on_cpu(), megatron_world(ParallelSizes(), 0, backend="gloo"):
        tensor = torch.arange(4.0)
        weakref.finalize(tensor.untyped_storage(), lambda: freed.append(threading.get_ident()))
        work = dist.all_reduce(tensor, async_op=True)
        work.wait()
        assert torch.equal(tensor, torch.arange(4.0))
        del tensor
        assert freed == [threading.get_ident()]  # freed at once, on this thread, while the work is still held
        gathered = torch.zeros(4)
        dist.all_gather_into_tensor(gathered, torch.arange(4.0), group=parallel_state.get_tensor_model_parallel_group())
        assert torch.equal(gathered, torch.arange(4.0))
        del work


def test_megatron_collectives_wait_for_their_release_on_a_real_rank_and_are_restored():
    # NOTE [gloo's late release in Megatron's collectives]: every collective megatron-core calls, under each name it
    # holds, waits for its release while a real rank of several processes runs (asynchronous ones when waited for)
    import importlib

    import torch.distributed as dist

    from remat.megatron.released_collectives import ALIASES, COLLECTIVES, collectives_released

    owners = [(dist, name) for name in COLLECTIVES] + [(importlib.import_module(m), n) for m, n in ALIASES]
    originals = [getattr(owner, name) for owner, name in owners]
    # megatron-core's aliases are torch's collectives themselves (bound at import), so wrapping both covers its calls
    assert all(getattr(importlib.import_module(m), n) in originals[:len(COLLECTIVES)] for m, n in ALIASES)
    with collectives_released():
        assert all(getattr(getattr(owner, name), "waits_for_release", False) for owner, name in owners)
        with megatron_on_cpu(), megatron_world(ParallelSizes(), 0, backend="fake"):
            tensor = torch.arange(4.0)
            before = tensor._use_count()
            dist.all_reduce(tensor)
            assert torch.equal(tensor, torch.arange(4.0)) and tensor._use_count() == before
            work = dist.all_reduce(tensor, async_op=True)  # waits for the release when its caller waits
            assert type(work).__name__ == "ReleasingWork" and work.wait() and tensor._use_count() == before
            assert work.wait() and work.is_completed()
    assert [getattr(owner, name) for owner, name in owners] == originals
