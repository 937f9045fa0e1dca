"""torch's lookup of a dispatch mode's registered operator rules in one call, for the CLI
(:func:`fast_dispatch_rules`).

NOTE [dispatch rules in one call]: for each operator dispatched to a Python dispatch mode or tensor subclass (every
operator of a fake trace, once for each mode it passes), torch's C++ argument parser calls
``torch._library.simple_registry.find_torch_dispatch_rule(op, type)``: whether a rule is registered for that
operator and mode type (``torch.library.register_torch_dispatch``). That is three Python calls (the registry's
``find``, which also makes an empty entry for each operator it is asked about, then the entry's rule holder's
``find``), about 56,000 times in the 70B plan. :func:`fast_dispatch_rules` puts in its place one function that reads
the same two dictionaries (an operator without an entry has no rule: None, as torch's answers). The parser looks the
function up once, on its first use: it is put in place before any operator is dispatched (the console script, after
its imports), else it changes nothing. It is put in place only where torch's registry has the fields it reads
(torch 2.13); a library user's process keeps torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch._library import simple_registry

_TORCHS = simple_registry.find_torch_dispatch_rule
_ENTRIES: dict[str, Any] = getattr(simple_registry.singleton, "_data", None)  # operator name -> its entry


def find_torch_dispatch_rule(op: Any, torch_dispatch_class: type) -> Callable[..., Any] | None:
    """The rule registered for operator ``op`` under dispatch mode or tensor subclass ``torch_dispatch_class``, or
    None: torch's ``find_torch_dispatch_rule`` in one call (NOTE [dispatch rules in one call])."""
    entry = _ENTRIES.get(op.__qualname__)
    return None if entry is None else entry.torch_dispatch_rules._data.get(torch_dispatch_class)


def supported() -> bool:
    """Whether torch's registry holds its entries, and each entry its rules, where :func:`find_torch_dispatch_rule`
    reads them."""
    entry = simple_registry.SimpleOperatorEntry("remat::probe")
    return isinstance(_ENTRIES, dict) and isinstance(getattr(entry.torch_dispatch_rules, "_data", None), dict)


def fast_dispatch_rules() -> bool:
    """Put :func:`find_torch_dispatch_rule` in torch's place (see the module docstring); True if it was put."""
    if simple_registry.find_torch_dispatch_rule is not _TORCHS or not supported():
        return False
    simple_registry.find_torch_dispatch_rule = find_torch_dispatch_rule
    return True
