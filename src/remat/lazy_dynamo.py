"""``torch._dynamo`` imported only when something compiles: a second of every ``remat`` command's start.

Fake-tensor tracing touches ``torch._dynamo`` three ways, none of which needs the compiler:

* ``FakeTensorMode()`` reads ``torch._dynamo.config`` (torch/_subclasses/fake_tensor.py ``FakeTensorMode.__init__``);
* converting a tensor imports ``torch._dynamo.source`` and its few submodules (meta_utils.py ``meta_tensor``);
* torch functions wrapped by ``torch._compile._disable_dynamo`` call ``torch._dynamo.disable(fn)`` on first use.

Yet ``import torch._dynamo.config`` first runs the package's ``__init__``, which imports the whole compiler (about
1.3 s of a 2-core machine's 2-3 s start). :func:`defer_dynamo` puts a stand-in package in ``sys.modules``: its
submodules import as usual, ``disable`` returns a wrapper that calls ``fn`` itself until the compiler is loaded
(without the compiler no frame is ever evaluated by dynamo, which is all ``disable`` guards against) and the real
disabled ``fn`` after, and any other attribute (``torch._dynamo.optimize``) or the import of any other submodule
(``torch.compile`` imports ``torch._dynamo.backends.registry``) runs the real ``__init__`` into the stand-in first,
so from then on it *is* ``torch._dynamo``, its submodules imported in the package's own order. Only the CLI
defers; a library user's process imports torch as it is.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

NAME = "torch._dynamo"
# the submodules fake tracing imports (torch._dynamo.source and what it imports): imported without the compiler
LIGHT = frozenset({"config", "source", "utils", "bytecode_analysis", "bytecode_transformation", "graph_utils",
                   "metrics_context"})


class _DeferredDynamo(types.ModuleType):
    """``torch._dynamo`` before its ``__init__`` has run (see the module docstring)."""

    loaded = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in LIGHT:  # a light submodule not imported yet: just it
            return importlib.import_module(f"{NAME}.{name}")
        if name == "disable" and not _DeferredDynamo.loaded:
            return _deferred_disable
        load_dynamo()
        return self.__dict__[name] if name in self.__dict__ else super().__getattribute__(name)


class _LoadFirst(importlib.abc.MetaPathFinder):
    """Runs the package's ``__init__`` before any submodule but :data:`LIGHT` is imported (a meta-path finder that
    finds nothing itself unless the ``__init__`` imported the module: then it hands that one over)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if _DeferredDynamo.loaded or not fullname.startswith(NAME + ".") or fullname.split(".")[2] in LIGHT:
            return None
        load_dynamo()
        module = sys.modules.get(fullname)
        return None if module is None else importlib.util.spec_from_loader(fullname, _Imported(module))


class _Imported(importlib.abc.Loader):
    """The loader of a module the package's ``__init__`` imported while it was being looked for."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec  # what importlib set it to, while handing it over, goes back


def _deferred_disable(fn: Callable[..., Any] | None = None, recursive: bool = True,
                      **kwargs: Any) -> Callable[..., Any]:
    """``torch._dynamo.disable`` while the compiler is not loaded: ``fn`` itself until it is."""
    if fn is None:  # used as a decorator factory
        return functools.partial(_deferred_disable, recursive=recursive, **kwargs)
    real: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        nonlocal real
        if real is None:
            if not _DeferredDynamo.loaded:
                return fn(*args, **kw)
            real = sys.modules[NAME].disable(fn, recursive, **kwargs)
        return real(*args, **kw)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]  # what the real one marks (eval_frame.py)
    return call


def defer_dynamo() -> bool:
    """Put the stand-in ``torch._dynamo`` in place unless the real one is imported already; True if it was put.
    torch itself is not imported here (``torch/__init__.py`` leaves ``_dynamo`` to its lazy ``__getattr__``, which
    finds the stand-in)."""
    if NAME in sys.modules:
        return False
    torch_spec = importlib.util.find_spec("torch")  # locates torch without importing it
    if torch_spec is None or torch_spec.origin is None:
        return False
    path = os.path.join(os.path.dirname(torch_spec.origin), "_dynamo")
    spec = importlib.util.spec_from_file_location(NAME, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    if spec is None or spec.loader is None:
        return False
    module = _DeferredDynamo(NAME)
    module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    module.__path__, module.__package__ = [path], NAME
    sys.modules[NAME] = module
    sys.meta_path.insert(0, _LoadFirst())
    return True


def load_dynamo() -> None:
    """Make ``torch._dynamo`` the whole compiler (a no-op when it is already): for code that records a real step
    or compiles."""
    module = sys.modules.get(NAME)
    if isinstance(module, _DeferredDynamo) and not _DeferredDynamo.loaded:
        _DeferredDynamo.loaded = True  # first: the __init__'s own submodule imports must not load it again
        assert module.__spec__ is not None and module.__spec__.loader is not None
        try:
            module.__spec__.loader.exec_module(module)
        except BaseException:
            _DeferredDynamo.loaded = False  # half run: the next use tries again and raises the same error
            raise
    else:
        import torch._dynamo  # noqa: F401


def import_for_steps(model: Any = None) -> None:
    """Import now what a recorded step of ``model`` would import on first use (a checkpointed function's
    ``torch._disable_dynamo``, a real tensor's fake conversion, ``torch.autograd.backward(tensors, grads)`` and a
    fake mode's first cache miss): all of ``torch._dynamo``, or with the stand-in
    ``torch.fx.experimental.symbolic_shapes`` (with sympy) and the submodules a conversion reaches
    (``torch._dynamo.source`` and what it imports). Imported inside a recorded step, module code would leave that
    step's frames (and their tensors) in reference cycles.

    With the stand-in, a model whose modules are all remat's or torch's own needs no ``torch._dynamo.source``: their
    code makes no real tensor inside a step (``torch.tensor(...)`` under a fake mode is such a conversion; remat's
    traces make their batches inside the fake mode too, :func:`remat.models.gpt.empty_batch`)."""
    if isinstance(sys.modules.get(NAME), _DeferredDynamo) and not _DeferredDynamo.loaded:
        import torch.fx.experimental.symbolic_shapes  # noqa: F401
        if model is None or not all(type(m).__module__.partition(".")[0] in ("remat", "torch")
                                    for m in model.modules()):
            importlib.import_module(f"{NAME}.source")
    else:
        import torch._dynamo  # noqa: F401
