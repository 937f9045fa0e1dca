"""Parts of torch the ``remat`` command line imports only when it uses them: ``torch._dynamo`` (the compiler, about a
second of every start) and the packages torch imports at its start that no command reads (:data:`UNUSED`).

Fake-tensor tracing touches ``torch._dynamo`` three ways, none of which needs the compiler:

* ``FakeTensorMode()`` reads ``torch._dynamo.config`` (torch/_subclasses/fake_tensor.py ``FakeTensorMode.__init__``);
* converting a tensor imports ``torch._dynamo.source`` and its few submodules (meta_utils.py ``meta_tensor``);
* torch functions wrapped by ``torch._compile._disable_dynamo`` call ``torch._dynamo.disable(fn)`` on first use.

Yet ``import torch._dynamo.config`` first runs the package's ``__init__``, which imports the whole compiler (about
1.3 s of a 2-core machine's 2-3 s start). And ``import torch`` itself runs the ``__init__`` of probability
distributions, masked tensors, the profiler, quantization with its ``torch.nn`` aliases and the data loaders
(``torch.utils.data``): about 150 modules, 0.1 s of CPU, for packages no command reads.

:func:`defer_torch` makes the first import of each such package a stand-in module (a meta-path finder hands it out;
the import binds it to its parent as usual). The package's ``__init__`` has not run: any attribute read on the stand-in
(``torch.distributions.Normal``, ``torch._dynamo.optimize``) or the import of any of its submodules (``torch.compile``
imports ``torch._dynamo.backends.registry``) runs it into the stand-in first, so from then on it *is* the package,
its submodules imported in the package's own order. ``torch._dynamo``'s stand-in is lighter still: its :data:`LIGHT`
submodules import without the ``__init__``, and ``disable`` returns a wrapper that calls ``fn`` itself until the
compiler is loaded (without the compiler no frame is ever evaluated by dynamo, which is all ``disable`` guards
against) and the real disabled ``fn`` after. Only the CLI defers; a library user's process imports torch as it is.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

NAME = "torch._dynamo"
# the submodules fake tracing imports (torch._dynamo.source and what it imports): imported without the compiler
LIGHT = frozenset({"config", "source", "utils", "bytecode_analysis", "bytecode_transformation", "graph_utils",
                   "metrics_context"})
# the packages torch/__init__.py imports that no remat command reads (none of remat's modules imports them; a command
# that reaches one, e.g. through a user's model, loads it then)
UNUSED = ("torch.distributions", "torch.masked", "torch.profiler", "torch.quantization", "torch.nn.intrinsic",
          "torch.nn.qat", "torch.nn.quantizable", "torch.nn.quantized", "torch.utils.data")

# each stand-in handed out whose package's __init__ has not run yet: its name -> the package's own spec
_PENDING: dict[str, importlib.machinery.ModuleSpec] = {}
# what torch._compile._disable_dynamo asked to disable while the compiler was not loaded: its answer, ``fn`` itself,
# is cached on ``fn`` as ``__dynamo_disable`` and dropped when the compiler loads (_load), so asked again then
_UNDISABLED: list[Callable[..., Any]] = []


class _Deferred(types.ModuleType):
    """A torch package whose ``__init__`` has not run (see the module docstring): any attribute but a dunder runs it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or self.__name__ not in _PENDING:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        _load(self)
        return getattr(self, name)


class _DeferredDynamo(_Deferred):
    """``torch._dynamo`` before its ``__init__`` has run: its light submodules and ``disable`` without it."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__") and self.__name__ in _PENDING:
            if name in LIGHT:  # a light submodule not imported yet: just it
                return importlib.import_module(f"{NAME}.{name}")
            if name == "disable":
                return _deferred_disable
        return super().__getattr__(name)


def _load(module: types.ModuleType) -> None:
    """Run the package's ``__init__`` into its stand-in ``module`` (a no-op once it has run)."""
    real = _PENDING.pop(module.__name__, None)  # first: the __init__'s own submodule imports must not load it again
    if real is None:
        return
    stand_in = module.__spec__
    module.__spec__, module.__loader__ = real, real.loader
    try:
        real.loader.exec_module(module)
    except BaseException:
        _PENDING[module.__name__], module.__spec__ = real, stand_in  # half run: the next use tries again, raising it
        raise
    if module.__name__ == NAME:
        for fn in _UNDISABLED:  # (torch/_compile.py's inner asks for the real disabled fn on its next call)
            vars(fn).pop("__dynamo_disable", None)
        _UNDISABLED.clear()


class _StandIn(importlib.abc.Loader):
    """Makes a package's stand-in (of ``kind``) and runs nothing into it: its ``__init__`` waits for :func:`_load`."""

    def __init__(self, kind: type[_Deferred]) -> None:
        self.kind = kind

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.kind(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Imported(importlib.abc.Loader):
    """The loader of a module the package's ``__init__`` imported while it was being looked for."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec  # what importlib set it to, while handing it over, goes back


class _Deferring(importlib.abc.MetaPathFinder):
    """Hands out a stand-in on the first import of each deferred package; before a pending package's submodule
    (but torch._dynamo's :data:`LIGHT` ones) is imported, runs the package's ``__init__`` and hands over the module
    if that imported it (else finds nothing: the usual finders import it)."""

    def __init__(self) -> None:
        self.waiting: set[str] = set()  # deferred packages not imported yet

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.waiting:
            self.waiting.discard(fullname)
            real = importlib.machinery.PathFinder.find_spec(fullname, path)
            if real is None or real.loader is None or real.submodule_search_locations is None:
                return None  # not a package here: imported as usual
            _PENDING[fullname] = real
            kind = _DeferredDynamo if fullname == NAME else _Deferred
            spec = importlib.machinery.ModuleSpec(fullname, _StandIn(kind), origin=real.origin, is_package=True)
            spec.submodule_search_locations = list(real.submodule_search_locations)
            spec.has_location = real.has_location  # __file__, as the package's own
            return spec
        package = next((name for name in _PENDING if fullname.startswith(name + ".")), None)
        if package is None or (package == NAME and fullname.split(".")[2] in LIGHT):
            return None
        _load(sys.modules[package])
        module = sys.modules.get(fullname)
        return None if module is None else importlib.util.spec_from_loader(fullname, _Imported(module))


_FINDER = _Deferring()


def defer(names: Iterable[str]) -> list[str]:
    """Make the first import of each of ``names`` (torch packages) a stand-in (see the module docstring), but of those
    imported already; returns the names deferred."""
    deferred = [name for name in names if name not in sys.modules]
    _FINDER.waiting.update(deferred)
    if deferred and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return deferred


def defer_torch() -> list[str]:
    """The CLI's deferral: ``torch._dynamo`` and :data:`UNUSED` (:func:`defer`). torch itself is not imported here."""
    return defer((NAME, *UNUSED))


def _deferred_disable(fn: Callable[..., Any] | None = None, recursive: bool = True,
                      **kwargs: Any) -> Callable[..., Any]:
    """``torch._dynamo.disable`` while the compiler is not loaded: ``fn`` itself until it is. torch's own
    ``_disable_dynamo`` (``wrapping=False``, e.g. every dispatch mode's ``__torch_dispatch__``: once an operator) gets
    ``fn`` as it is, asked again once the compiler loads; any other caller a wrapper that calls ``fn`` until then and
    the real disabled ``fn`` after."""
    if fn is None:  # used as a decorator factory
        return functools.partial(_deferred_disable, recursive=recursive, **kwargs)
    if kwargs.get("wrapping") is False and NAME in _PENDING and hasattr(fn, "__dict__"):
        _UNDISABLED.append(fn)
        return fn
    real: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        nonlocal real
        if real is None:
            if NAME in _PENDING:
                return fn(*args, **kw)
            real = sys.modules[NAME].disable(fn, recursive, **kwargs)
        return real(*args, **kw)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]  # what the real one marks (eval_frame.py)
    return call


def load_dynamo() -> None:
    """Make ``torch._dynamo`` the whole compiler (a no-op when it is already): for code that records a real step
    or compiles."""
    import torch._dynamo  # noqa: F401  (the stand-in, where the CLI defers it)

    _load(sys.modules[NAME])


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
    import torch._dynamo  # noqa: F401  (the whole compiler, unless the CLI deferred it: then its stand-in)

    if NAME in _PENDING:
        import torch.fx.experimental.symbolic_shapes  # noqa: F401
        if model is None or not all(type(m).__module__.partition(".")[0] in ("remat", "torch")
                                    for m in model.modules()):
            importlib.import_module(f"{NAME}.source")


def pending() -> list[str]:
    """The deferred packages imported as stand-ins whose ``__init__`` has not run yet, in the order imported."""
    return list(_PENDING)
