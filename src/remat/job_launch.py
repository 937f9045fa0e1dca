"""The world size a pasted launch line gives: ``torchrun --nnodes 4 --nproc-per-node 8 pretrain_gpt.py ...``.

Megatron-LM reads its world size from the launcher, not from its own flags, so a command line pasted whole carries it
only in the launcher's part (what precedes the training script). :func:`launcher_world_size` reads the launchers
Megatron jobs start with:

* ``torchrun`` / ``python -m torch.distributed.run`` (torch/distributed/run.py): ``--nnodes`` (``N`` or ``MIN:MAX``:
  MAX, the size the job reaches) x ``--nproc-per-node`` (also ``--nproc_per_node``); ``gpu``/``auto`` and shell
  variables are not numbers: unknown;
* ``srun`` (Slurm): ``--ntasks``/``-n``, else ``--nodes``/``-N`` x ``--ntasks-per-node``;
* ``mpirun`` / ``mpiexec``: ``-np``/``-n``/``--np``;
* ``deepspeed``: ``--num_nodes`` x ``--num_gpus``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

_TORCHRUN = {"nodes": ("--nnodes",), "per_node": ("--nproc-per-node", "--nproc_per_node")}
_SRUN = {"total": ("--ntasks", "-n"), "nodes": ("--nodes", "-N"), "per_node": ("--ntasks-per-node",)}
_MPI = {"total": ("-np", "-n", "--np")}
_DEEPSPEED = {"nodes": ("--num_nodes", "--num-nodes"), "per_node": ("--num_gpus", "--num-gpus")}


def _options(tokens: Sequence[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` pairs of a launcher's tokens (the last one given wins)."""
    out: dict[str, str] = {}
    for i, tok in enumerate(tokens):
        if not tok.startswith("-"):
            continue
        name, eq, value = tok.partition("=")
        if eq:
            out[name] = value
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            out[name] = tokens[i + 1]
    return out


def _number(text: str | None, *, take_max: bool = False) -> int | None:
    if text is None:
        return None
    if take_max and ":" in text:
        text = text.rpartition(":")[2]
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else None


def launcher_world_size(launcher: str | Sequence[str]) -> int | None:
    """The number of training processes a launch command starts, or None when it does not say (no launcher, or
    sizes given through variables the shell would expand).

    Args:
        launcher: the tokens before the training script (or that text), e.g. ``"torchrun --nproc_per_node 8
            --nnodes 2 pretrain_gpt.py"``.

    Example:
        >>> launcher_world_size("torchrun --nnodes 1:4 --nproc-per-node=8 pretrain_gpt.py")
        32
        >>> launcher_world_size("srun -N 2 --ntasks-per-node 8 python pretrain_gpt.py"), launcher_world_size(
        ...     "python pretrain_gpt.py")
        (16, None)
    """
    tokens = shlex.split(launcher) if isinstance(launcher, str) else list(launcher)
    words = [t.rsplit("/", 1)[-1] for t in tokens]
    opts = _options(tokens)

    def first(names: Sequence[str], take_max: bool = False) -> int | None:
        return next((n for n in (_number(opts.get(k), take_max=take_max) for k in names) if n), None)

    if "torchrun" in words or "torch.distributed.run" in tokens or "torch.distributed.launch" in tokens:
        per_node = first(_TORCHRUN["per_node"])
        return per_node * (first(_TORCHRUN["nodes"], take_max=True) or 1) if per_node else None
    if "srun" in words:
        total = first(_SRUN["total"])
        per_node = first(_SRUN["per_node"])
        return total or (per_node * (first(_SRUN["nodes"]) or 1) if per_node else None)
    if any(w in ("mpirun", "mpiexec") for w in words):
        return first(_MPI["total"])
    if "deepspeed" in words:
        per_node = first(_DEEPSPEED["per_node"])
        return per_node * (first(_DEEPSPEED["nodes"]) or 1) if per_node else None
    return None


def launcher_env(launcher: str | Sequence[str]) -> dict[str, str]:
    """The environment variables a launch command sets for its processes: its leading ``NAME=VALUE`` words (as a
    shell reads them; after ``env`` too), e.g. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun ...``.

    Example:
        >>> launcher_env("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc-per-node 8 pretrain_gpt.py")
        {'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True'}
    """
    tokens = shlex.split(launcher) if isinstance(launcher, str) else list(launcher)
    out: dict[str, str] = {}
    for i, tok in enumerate(tokens):
        name, eq, value = tok.partition("=")
        if eq and name.isidentifier():
            out[name] = value
        elif not (tok == "env" and i == len(out)):  # the first command word ends the assignments
            break
    return out
