"""Which megatron-core this front end works with, and the one-line errors when it is missing or different.

megatron-core is an optional dependency (``pip install 'remat[megatron]'``): nothing here imports it at module
level, so ``import remat.megatron`` works without it and every entry point calls :func:`require_megatron_core`.
"""

from __future__ import annotations

from importlib import metadata
from types import ModuleType

# The release the CPU/fake-tensor workarounds were written against and tested with (tests/megatron). megatron-core
# 0.17 and later declare Python >= 3.12; 0.16.1 is what pip resolves on Python 3.11 with torch 2.13 (CPU).
TESTED_VERSIONS = ("0.16.1",)
INSTALL_HINT = "pip install 'remat[megatron]' (megatron-core==0.16.1)"


class MegatronUnavailable(ImportError):
    """megatron-core is not installed, or is a version whose internals the workarounds were not checked on."""


class MegatronSettingError(ValueError):
    """A Megatron setting that megatron-core cannot run here (one of its own bugs, or a CUDA-only feature);
    the message names the setting and what to use instead."""


def installed_version() -> str | None:
    """The installed megatron-core's version, or None when it is not installed."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def require_megatron_core(allow_untested: bool = False) -> ModuleType:
    """Import ``megatron.core`` and check its version against :data:`TESTED_VERSIONS`.

    Args:
        allow_untested: accept another version (the workarounds check the internals they touch and fail with a
            one-line error naming the attribute when one is gone).

    Returns:
        The ``megatron.core`` module.
    """
    version = installed_version()
    if version is None:
        raise MegatronUnavailable(f"megatron-core is not installed: {INSTALL_HINT}")
    if version not in TESTED_VERSIONS and not allow_untested:
        raise MegatronUnavailable(f"megatron-core {version} is installed, but remat's Megatron front end is tested "
                                  f"with {', '.join(TESTED_VERSIONS)}: {INSTALL_HINT}, or pass "
                                  "allow_untested=True")
    import warnings

    with warnings.catch_warnings():  # "Apex is not installed", "Transformer Engine is not installed", ...
        warnings.simplefilter("ignore")
        import megatron.core
        import megatron.core.models.gpt  # noqa: F401
    return megatron.core
