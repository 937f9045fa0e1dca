"""The training launch a Megatron-LM launch script makes, read without running training or acting on the machine.

``remat predict --megatron-script train.sh ARGS`` prices the job a launch script starts, as users have it: the
script computes its flags (arrays, defaults, ``if`` branches, ``source``d configs, its own arguments), so remat runs
it, but in a sandbox where nothing it calls runs (:func:`read_launch_script`):

* ``bash -r`` (restricted: no command name with a ``/``, no ``cd``, no output redirection ``>``/``>>``, no ``exec``,
  ``PATH`` read-only), started with ``--noprofile --norc`` in a new temporary directory (its working directory)
  that holds a copy of the script, stand-ins of Megatron-LM's entry scripts (``pretrain_gpt.py``, ... : scripts
  check that they exist) and read-only copies of the files it may ``source``: the files of its directory that
  its text names and the files its arguments name;
* ``PATH`` holds one directory of shims: the launchers (:data:`LAUNCHERS`) record their command line (argv) and exit
  0 (a launcher that runs a shell's command string, ``srun ... bash -c "CMD"``, has ``CMD`` read in place, in a
  subshell of the same restricted shell, its launches recorded behind the launcher's words: ``srun ... python
  pretrain_gpt.py ...``); ``sbatch`` submits nothing: the job script it would submit (``--wrap CMD``, a script file
  the sandbox holds, or its standard input, e.g. a heredoc) is read in place the same way, and the answer says so;
  ``dirname``/``basename`` compute their answer (they only edit a string). Any other command (``mkdir``,
  ``nvidia-smi``, ``scontrol``, ``rm``, ...) is not found: bash's ``command_not_found_handle`` records it as
  skipped and returns 0 without output; ``cd``/``pushd``/``popd`` are recorded and change nothing; the ``kill``,
  ``history`` and ``fc`` builtins are disabled; ``source FILE`` reads only the sandbox's copies; bash's own temporary
  files (large heredocs) go to the sandbox (``TMPDIR``, read-only for the script);
* a timeout (:data:`DEFAULT_TIMEOUT`) ends a script that loops (SIGTERM, then SIGKILL to its process group), and the
  line it reached is recorded; so is the line each command was called from (a ``DEBUG`` trap).

The answer says which launch it took (script and line, its whole command line) and lists what was skipped. Reading
files is not blocked (a script may test ``-f``/``-d`` or read ``< FILE``): the sandbox only stops actions.
Limits: a ``source``d file that uses ``declare`` makes those variables local to remat's ``source`` wrapper; the
script's environment is remat's own (variables such as ``TP=2`` set before ``remat`` reach it), less what would
change how bash or the shims start (``BASH_ENV``, ``SHELLOPTS``, ``LD_*``, exported functions, ...).
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from remat.job_flags import JobError
from remat.limits import read_input_text

LAUNCHERS = ("torchrun", "python", "python3", "srun", "mpirun", "mpiexec", "deepspeed")
"""Commands whose command line is recorded as a launch (none of them runs)."""
GPT_ENTRY = "pretrain_gpt.py"
# Megatron-LM's entry scripts (the repository's root at d98e8a6, and older ones scripts still call): stand-ins of
# each exist in the sandbox; the value says why remat does not price the ones other than pretrain_gpt.py
ENTRY_SCRIPTS: dict[str, str | None] = {
    GPT_ENTRY: None, "pretrain_mamba.py": "Mamba / hybrid models", "pretrain_hybrid.py": "Mamba / hybrid models",
    "pretrain_vlm.py": "vision-language models", "train_rl.py": "reinforcement learning (with inference engines)",
    "pretrain_bert.py": "BERT", "pretrain_t5.py": "T5", "pretrain_retro.py": "RETRO", "pretrain_ict.py": "ICT",
    "pretrain_vision_classify.py": "vision models",
}
DEFAULT_TIMEOUT = 10.0
"""Seconds a script may run while it is read (a launch script computes its flags in milliseconds)."""
MAX_SOURCED_FILE_BYTES = 1 << 20
"""Files larger than this (1 MiB) are not copied into the sandbox (a sourced config is a few hundred bytes)."""
_MAX_RECORD_BYTES = 8 << 20  # a looping script may call a launcher many times: the first records are enough
_TAIL_BYTES = 16 << 10  # the end of the script's own output, for its error
_SHOWN_SKIPPED = 12


class ScriptError(JobError):
    """A launch script remat cannot read one training launch from; the message names the script, the line it
    reached and its own last output."""


@dataclass(frozen=True)
class ScriptCommand:
    """One command a script called while it was read (recorded, never run)."""

    argv: tuple[str, ...]
    where: str
    """``"train.sh line 12"`` (the file and line it was called from), or ``"train.sh"`` when unknown."""

    def text(self, limit: int | None = None) -> str:
        """The command line, quoted as a shell would take it (cut to ``limit`` characters)."""
        text = shlex.join(self.argv)
        return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class ScriptLaunch:
    """The training launch a script makes, with what was skipped while reading it."""

    script: str
    """The script, as given."""
    command: ScriptCommand
    """The launch taken: launcher, entry script and Megatron's flags."""
    skipped: tuple[ScriptCommand, ...] = ()
    """Commands not run (not found, ``cd``, launches that start no training), in order."""
    notes: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    """The environment variables the script set for the launch (``export PYTORCH_CUDA_ALLOC_CONF=...``)."""

    @property
    def argv(self) -> list[str]:
        """The launch's command line (``torchrun ... pretrain_gpt.py --num-layers ...``)."""
        return list(self.command.argv)

    def lines(self) -> list[str]:
        """The answer's lines about the script: the launch taken, then what was skipped."""
        out = [f"launch read from {self.command.where} (nothing ran): {self.command.text()}"]
        if self.skipped:
            own = Path(self.script).name + " "
            shown = [f"{c.text(60)} ({c.where.removeprefix(own)})" for c in self.skipped[:_SHOWN_SKIPPED]]
            more = len(self.skipped) - _SHOWN_SKIPPED
            out.append(f"skipped while reading {Path(self.script).name} (not run): " + "; ".join(shown)
                       + (f"; and {more} more" if more > 0 else ""))
        return out + list(self.notes)

    def to_dict(self) -> dict[str, Any]:
        return {"script": self.script, "launch": list(self.command.argv), "launch_from": self.command.where,
                "skipped": [{"argv": list(c.argv), "from": c.where} for c in self.skipped], "notes": list(self.notes),
                "env": dict(self.env)}


# ------------------------------------------------------------------------------------------------ the sandbox
_RECORD = "\\036REC\\0%s\\0%s\\0%s\\0"  # printf format: marker, kind, where, number of argv fields

# What the launchers, dirname and basename do: bash functions in the sandbox's startup file (nothing is started),
# and the same in the PATH shims (for ``command torchrun``); {sink} is where the records go.
_FUNCTIONS = """__remat_rec() {{  # one printf, so one write: records of commands in one pipeline do not interleave
  local __remat_fmt='{fmt}' __remat_k
  for (( __remat_k = 1; __remat_k < $#; __remat_k++ )); do __remat_fmt+='%s\\0'; done
  printf "$__remat_fmt" "$1" "${{REMAT_WHERE-}}" "$(( $# - 1 ))" "${{@:2}}" {sink}
}}
__remat_launch() {{  # a launcher: its command line and environment are recorded; nothing runs
  local __remat_e=() __remat_v
  for __remat_v in $(compgen -e); do  # no 2>/dev/null: bash -r refuses any ">"
    __remat_e+=("$__remat_v=${{!__remat_v}}"); done
  __remat_rec launch "$@"
  __remat_rec env "${{__remat_e[@]}}"
  return 0
}}
__remat_dirname() {{  # dirname and basename only edit a string: they answer (POSIX semantics)
  local p=${{1-}}; [[ $p == -- ]] && p=${{2-}}
  [[ $p =~ ^/+$ ]] && {{ printf '/\\n'; return 0; }}
  while [[ $p == */ ]]; do p=${{p%/}}; done
  [[ $p == */* ]] || {{ printf '.\\n'; return 0; }}
  p=${{p%/*}}; while [[ $p == */ ]]; do p=${{p%/}}; done
  printf '%s\\n' "${{p:-/}}"
}}
__remat_basename() {{
  [[ ${{1-}} == -- ]] && shift
  local p=${{1-}}; [[ $p =~ ^/+$ ]] && {{ printf '/\\n'; return 0; }}
  while [[ $p == */ ]]; do p=${{p%/}}; done
  p=${{p##*/}}; [[ -n ${{2-}} && $p != "$2" ]] && p=${{p%"$2"}}
  printf '%s\\n' "$p"
}}
"""
_SHIM = "#!{bash} -p\n{functions}{call} \"$@\"\n"
# Read by bash before -r restricts it (BASH_ENV): the record descriptor, the traps, the wrappers.
_STARTUP = """exec 9>>{record}
enable -n kill history fc
unset LD_PRELOAD LD_LIBRARY_PATH LD_AUDIT
readonly LD_PRELOAD LD_LIBRARY_PATH LD_AUDIT TMPDIR
__remat_self={startup}
readonly __remat_self
set -T
{functions}{launchers}dirname() {{ __remat_dirname "$@"; }}
basename() {{ __remat_basename "$@"; }}
# a launcher that runs a shell's command string (srun ... bash -x -c "CMD"): CMD is read in place, in a subshell,
# and the launches it makes are recorded behind the launcher's words (__remat_outer: srun ... python ...)
__remat_outer=()
__remat_run() {{
  local __remat_w=("$@") __remat_i __remat_j __remat_c
  for (( __remat_i = 1; __remat_i < $#; __remat_i++ )); do
    case ${{__remat_w[__remat_i]##*/}} in bash|sh|dash|zsh|ksh) ;; *) continue ;; esac
    __remat_c=
    for (( __remat_j = __remat_i + 1; __remat_j < $#; __remat_j++ )); do
      case ${{__remat_w[__remat_j]}} in --*) ;; -*c*) __remat_c=1 ;; -*) ;; *) break ;; esac
    done
    [[ -n $__remat_c && __remat_j -lt $# ]] || break
    ( __remat_outer+=("${{__remat_w[@]:0:__remat_i}}"); eval "${{__remat_w[__remat_j]}}" )
    return 0
  done
  __remat_launch "${{__remat_outer[@]}}" "$@"
}}
# sbatch submits nothing: the job script it would submit (--wrap CMD, a script file of the sandbox, or its standard
# input: a heredoc) is read in place, in a subshell
sbatch() {{
  local __remat_a __remat_job= __remat_n=0 __remat_f=
  for __remat_a in "$@"; do
    __remat_n=$(( __remat_n + 1 ))
    case $__remat_a in
      --wrap=*) __remat_job=${{__remat_a#--wrap=}}; break ;;
      --wrap) __remat_job=${{@:__remat_n+1:1}}; break ;;
      -*) ;;
      *) __remat_f=$(__remat_find "$__remat_a") && break; __remat_f= ;;
    esac
  done
  if [[ -n $__remat_f ]]; then
    __remat_rec submitted "$__remat_f" sbatch "$@"
    ( shift "$__remat_n"; builtin source "$__remat_f" "$@" )
    return 0
  fi
  [[ -n $__remat_job ]] || IFS= read -r -d '' __remat_job
  if [[ -z $__remat_job ]]; then
    __remat_rec skipped sbatch "$@"
    printf '%s\\n' "remat: sbatch: no job script in the sandbox, no --wrap and nothing on its input: nothing read" >&2
    return 0
  fi
  __remat_rec submitted "" sbatch "$@"
  ( eval "$__remat_job" )
  return 0
}}
# each command's file and line (REMAT_WHERE, read by the shims); a trap handler's own command counts too, so the
# handlers report the line before it (__remat_prev)
__remat_line() {{ __remat_prev=$REMAT_WHERE; REMAT_WHERE="${{BASH_SOURCE[1]##*/}}:$1"; }}
trap '[[ ${{BASH_SOURCE[0]-}} == "$__remat_self" ]] || __remat_line "$LINENO"' DEBUG
export REMAT_WHERE=
__remat_end() {{ trap - DEBUG; REMAT_WHERE=$__remat_prev; __remat_rec "$@"; }}
trap '__remat_end end "$?"' EXIT
trap '__remat_end timeout; exit 124' TERM
command_not_found_handle() {{ __remat_rec skipped "$@"; return 0; }}
cd() {{ __remat_rec skipped cd "$@"; return 0; }}
pushd() {{ __remat_rec skipped pushd "$@"; return 0; }}
popd() {{ __remat_rec skipped popd "$@"; return 0; }}
__remat_find() {{  # the sandbox's copy of a file the script names (printed), or status 1
  local __remat_p=$1 __remat_k __remat_f=
  __remat_k=${{__remat_p#"$PWD"/}}
  while [[ $__remat_k == ./* ]]; do __remat_k=${{__remat_k#./}}; done
  case $__remat_p in
{cases}  esac
  if [[ -z $__remat_f && $__remat_k != */* && -f $__remat_k ]]; then __remat_f=$__remat_k; fi
  [[ -n $__remat_f ]] && printf '%s\\n' "$__remat_f"
}}
__remat_source() {{
  (( $# )) || {{ builtin source; return; }}
  local __remat_p=$1 __remat_f; shift
  __remat_f=$(__remat_find "$__remat_p")
  if [[ -z $__remat_f ]]; then
    __remat_rec skipped source "$__remat_p" "$@"
    printf '%s\\n' "remat: source $__remat_p: not in the sandbox (it holds copies of the script's own" \\
      "directory's files and of the files its arguments name)" >&2
    return 1
  fi
  builtin source "$__remat_f" "$@"
}}
source() {{ __remat_source "$@"; }}
.() {{ __remat_source "$@"; }}
"""
_BASH_OWN = ("PWD", "OLDPWD", "REMAT_WHERE", "SHLVL", "_")
# Variables that would change how bash, or the shims it starts, behave: not passed to the script.
_DROPPED_ENV = ("BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "CDPATH", "GLOBIGNORE", "BASH_XTRACEFD", "PS4",
                "PROMPT_COMMAND", "POSIXLY_CORRECT", "IFS", "REMAT_WHERE", "TMOUT", "EXECIGNORE", "HISTFILE")


def _copy_read_only(src: Path, dst: Path) -> bool:
    try:
        if not src.is_file() or src.stat().st_size > MAX_SOURCED_FILE_BYTES:
            return False
        shutil.copyfile(src, dst)
    except OSError:
        return False
    dst.chmod(0o444)
    return True


def _sandbox_files(root: Path, script: Path, given: str, text: str, args: Sequence[str]) -> dict[str, str]:
    """Copy what the script may source into ``root``; returns {path as the script may write it: sandbox name}."""
    taken = {*ENTRY_SCRIPTS, script.name}
    files: dict[str, str] = {}
    folder, shown_folder = script.resolve().parent, os.path.dirname(given)
    try:
        siblings = sorted(folder.iterdir()) if folder.is_dir() else []
    except OSError:
        siblings = []
    copied = 0
    for sibling in siblings[:1000]:  # the files of the script's directory that its text names (64 at most)
        name = sibling.name
        if copied >= 64 or name in taken or name not in text or not name.isprintable() or name.startswith("."):
            continue
        copied += 1
        if _copy_read_only(sibling, root / name):
            taken.add(name)
            for key in (name, f"{folder}/{name}", *([f"{shown_folder}/{name}"] if shown_folder else [])):
                files[key] = name
    values = [a.partition("=")[2] if a.startswith("-") and "=" in a else a for a in args]
    for i, value in enumerate(values):  # files its arguments name (e.g. --distributed-config-file FILE)
        if not value or "\n" in value:
            continue
        path = Path(value)
        name = f".remat-arg-{i}-{path.name}"
        try:
            usable = path.is_file()
        except OSError:
            usable = False
        if usable and name.isprintable() and _copy_read_only(path, root / name):
            files[value] = name
            files[str(path.resolve())] = name
    return files


def _absolute(args: Sequence[str]) -> list[str]:
    """``args`` with each relative path that exists (from the caller's directory) made absolute: the script runs in
    the sandbox, where it tests them (``[ -f "$2" ]``) and sources them."""
    out = []
    for arg in args:
        try:
            exists = bool(arg) and "\n" not in arg and not os.path.isabs(arg) and os.path.exists(arg)
        except (OSError, ValueError):
            exists = False
        out.append(os.path.abspath(arg) if exists else arg)
    return out


def _startup(startup: Path, record: Path, files: dict[str, str]) -> str:
    cases = "".join(f"    {shlex.quote(key)}) __remat_f={shlex.quote(name)} ;;\n" for key, name in files.items())
    launchers = "".join(f'{name}() {{ __remat_run {name} "$@"; }}\n' for name in LAUNCHERS)
    return _STARTUP.format(record=shlex.quote(str(record)), startup=shlex.quote(str(startup)), cases=cases,
                           functions=_FUNCTIONS.format(fmt=_RECORD, sink=">&9"), launchers=launchers)


def _shims(bash: str, record: Path) -> dict[str, str]:
    """The PATH shims (name: script): the launchers, dirname and basename, as the startup file's functions."""
    functions = _FUNCTIONS.format(fmt=_RECORD, sink=f">> {shlex.quote(str(record))}")
    shims = {name: _SHIM.format(bash=bash, functions=functions, call=f"__remat_launch {name}") for name in LAUNCHERS}
    shims.update({name: _SHIM.format(bash=bash, functions=functions, call=f"__remat_{name}")
                  for name in ("dirname", "basename")})
    return shims


def _environment(bin_dir: Path, startup: Path, tmp: Path, root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _DROPPED_ENV and not k.startswith(("BASH_FUNC_", "LD_", "DYLD_"))}
    env.update(PATH=str(bin_dir), BASH_ENV=str(startup), TMPDIR=str(tmp), PWD=str(root), OLDPWD=str(root))
    return env


# ------------------------------------------------------------------------------------------------ running it
class _Tail(threading.Thread):
    """Reads a stream to its end, keeping its last bytes."""

    def __init__(self, stream: Any) -> None:
        super().__init__(daemon=True)
        self.stream, self.data = stream, b""

    def run(self) -> None:
        while chunk := self.stream.read1(65536):
            self.data = (self.data + chunk)[-_TAIL_BYTES:]


def _end_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the script's own process group (start_new_session): its leftovers
    except (ProcessLookupError, PermissionError):
        pass


def _run(bash: str, root: Path, name: str, args: Sequence[str], env: dict[str, str],
         timeout: float) -> tuple[int | None, bool, str]:
    """Run the script; returns (exit status or None, timed out, its output's last lines)."""
    proc = subprocess.Popen([bash, "--noprofile", "--norc", "-r", name, *args], cwd=root, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    tail = _Tail(proc.stdout)
    tail.start()
    timed_out = False
    try:
        status: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # its TERM trap records the line it reached
        except ProcessLookupError:
            pass
        try:
            status = proc.wait(1.0)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            status = proc.wait()
    finally:
        _end_group(proc)
    tail.join(2.0)
    if proc.stdout is not None:
        proc.stdout.close()
    return status, timed_out, tail.data.decode("utf-8", "replace")


def _records(data: bytes) -> list[tuple[str, str, tuple[str, ...]]]:
    """(kind, where, argv) of each record the shims and the traps wrote."""
    fields = data.split(b"\0")
    out, i = [], 0
    while i + 3 < len(fields):
        if fields[i] != b"\x1eREC" or not fields[i + 3].isdigit():
            i += 1  # not a record's start (a script wrote to descriptor 9): resynchronise
            continue
        n = int(fields[i + 3])
        argv = tuple(f.decode("utf-8", "surrogateescape") for f in fields[i + 4:i + 4 + n])
        out.append((fields[i + 1].decode("utf-8", "replace"), fields[i + 2].decode("utf-8", "replace"), argv))
        i += 4 + n
    return out


def _where(raw: str, names: dict[str, str]) -> str:
    file, _, line = raw.rpartition(":")
    if not file:
        return names.get(raw, raw) or "the script"
    return f"{names.get(file, file)} line {line}" if line.isdigit() else names.get(file, file)


def _last_output(output: str, limit: int = 300) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return "it printed nothing"
    text = " | ".join(lines[-3:])
    text = text if len(text) <= limit else "..." + text[-(limit - 3):]
    return f"its output ended with: {text if text.isprintable() else ascii(text)}"


def _training_scripts(argv: Sequence[str]) -> list[str]:
    return [t for t in argv[1:] if t.endswith(".py")]


def _choose(script: str, launches: list[ScriptCommand], ending: str) -> tuple[ScriptCommand, list[ScriptCommand]]:
    """The launch that starts training, and the other launches (skipped)."""
    names = ", ".join(LAUNCHERS)
    if not launches:
        raise ScriptError(f"{script} {ending} without calling a launcher ({names})")
    training = [c for c in launches if _training_scripts(c.argv)]
    if not training:
        shown = "; ".join(f"{c.text(120)} ({c.where})" for c in launches[:3])
        raise ScriptError(f"{script}: its launch names no training script (e.g. {GPT_ENTRY}): {shown}")
    if len(training) > 1:
        entries = [c for c in training if Path(_training_scripts(c.argv)[0]).name in ENTRY_SCRIPTS]
        training = entries if len(entries) == 1 else training
    if len(training) > 1:
        shown = "; ".join(f"{c.where}: {c.text(100)}" for c in training[:4])
        raise ScriptError(f"{script} launches training {len(training)} times ({shown}): remat prices one job; give "
                          "the one to price with --megatron-args")
    chosen = training[0]
    scripts = _training_scripts(chosen.argv)
    if len(scripts) > 1:
        raise ScriptError(f"{script}: the launch at {chosen.where} names {len(scripts)} training scripts "
                          f"({', '.join(scripts)}): {chosen.text(200)}; a launch runs one")
    why = ENTRY_SCRIPTS.get(Path(scripts[0]).name)
    if why:
        raise ScriptError(f"{script}: the launch at {chosen.where} runs {Path(scripts[0]).name}, Megatron-LM's entry "
                          f"for {why}; remat prices the models of {GPT_ENTRY}")
    return chosen, [c for c in launches if c is not chosen]


def read_launch_script(script: str | os.PathLike[str], args: Sequence[str] = (), *,
                       timeout: float = DEFAULT_TIMEOUT) -> ScriptLaunch:
    """The training launch a Megatron-LM launch script makes, read in a sandbox where nothing runs.

    Args:
        script: the launch script (a bash script; ``#!/bin/sh`` scripts run under bash too).
        args: its arguments, as it would be called with them.
        timeout: seconds the script may run (> 0); one that is still running then is ended and refused.

    Returns:
        The :class:`ScriptLaunch`: the launch's command line (launcher, entry script and flags), where it was called
        from, and the commands skipped. Raises :class:`ScriptError` (a :class:`JobError`) when the script cannot be
        read, fails, loops or never launches training, naming the line it reached and its own last output; when it
        launches training more than once, or its launch names two training scripts or none.

    Example:
        >>> launch = read_launch_script("train_gpt3_175b_distributed.sh", ["ckpt", "tb"])  # doctest: +SKIP
        >>> launch.argv[:3]  # doctest: +SKIP
        ['torchrun', '--nproc_per_node', '8']
    """
    given = os.fspath(script)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 3600:
        raise ScriptError(f"timeout={timeout!r}: give seconds between 0 and 3600")
    if not all(isinstance(a, str) for a in args):
        raise ScriptError(f"the script's arguments must be strings, got {list(args)!r}")
    path = Path(given)
    try:
        text = read_input_text(path)
    except (OSError, UnicodeDecodeError) as err:
        raise ScriptError(f"cannot read the launch script {given!r} ({err}): give a bash script") from None
    bash = shutil.which("bash")
    if bash is None or not bash.isprintable() or any(c.isspace() for c in bash):
        raise ScriptError("reading a launch script needs bash on PATH (at a path without spaces): give the launch "
                          "line with --megatron-args instead")
    with tempfile.TemporaryDirectory(prefix="remat-script-") as tmp:
        base = Path(tmp)
        root, meta = base / "run", base / "meta"
        root.mkdir()
        (meta / "bin").mkdir(parents=True)
        (meta / "tmp").mkdir()
        name = path.name if path.name.isprintable() and path.name not in ENTRY_SCRIPTS else "launch.sh"
        (root / name).write_text(text)
        for entry in ENTRY_SCRIPTS:
            (root / entry).write_text("# remat: a stand-in of Megatron-LM's entry script (nothing runs)\n")
        args = _absolute(args)
        files = _sandbox_files(root, path, given, text, args)
        record, startup = meta / "record", meta / "startup.sh"
        record.touch()
        for shim, body in _shims(bash, record).items():
            (meta / "bin" / shim).write_text(body)
            (meta / "bin" / shim).chmod(0o555)
        startup.write_text(_startup(startup, record, files))
        for p in (root / entry for entry in ENTRY_SCRIPTS):
            p.chmod(0o444)
        (root / name).chmod(0o444)
        root.chmod(0o555)  # read-only: nothing the script starts may write there either
        try:
            env = _environment(meta / "bin", startup, meta / "tmp", root)
            status, timed_out, output = _run(bash, root, name, args, env, timeout)
        finally:
            root.chmod(0o755)
        with open(record, "rb") as f:
            data = f.read(_MAX_RECORD_BYTES)
    names = {name: path.name, **{sandbox: key for key, sandbox in files.items() if sandbox.startswith(".remat-arg-")}}
    launch = _launch(given, _records(data), names, status, timed_out, output, timeout)
    # what the script set: the launch's variables that differ from those it started with (bash's own aside)
    changed = {k: v for k, v in launch.env.items() if k not in _BASH_OWN and env.get(k) != v}
    return replace(launch, env=changed)


def _launch(given: str, records: list[tuple[str, str, tuple[str, ...]]], names: dict[str, str], status: int | None,
            timed_out: bool, output: str, timeout: float) -> ScriptLaunch:
    launches, skipped, reached, envs, submitted = [], [], None, {}, []
    for kind, where, argv in records:
        command = ScriptCommand(argv, _where(where, names))
        if kind == "submitted" and argv:  # sbatch: (the sandbox's job script file or "", sbatch's own argv)
            script_file = f"its job script {names.get(argv[0], argv[0])}" if argv[0] else (
                "the job script given with --wrap" if any(a.startswith("--wrap") for a in argv[1:])
                else "the job script on its input")
            submitted.append(f"{ScriptCommand(argv[1:], '').text(60)} at {command.where}: nothing submitted; "
                             f"{script_file} was read in place")
        elif kind == "env" and launches:
            envs.setdefault(id(launches[-1]), dict(a.partition("=")[::2] for a in argv))
        elif kind == "launch":
            launches.append(command)
        elif kind == "skipped" and argv:
            skipped.append(command)
        elif kind in ("end", "timeout") and reached is None:
            reached = command.where
    # the commands of one pipeline run at once and record in whichever order they start: those of one line (a
    # pipeline, a heredoc job script) are listed by their words, so that the answer is the same each run
    skipped = [c for _, same in itertools.groupby(skipped, key=lambda c: c.where)
               for c in sorted(same, key=lambda c: c.argv)]
    at = f"at {reached}" if reached else "(the line it reached is unknown)"
    if timed_out:
        ending = f"was still running after the {timeout:g} s timeout {at}: it loops or waits"
    else:
        ending = f"ended (exit status {status}) {at}"
    skipped_text = "; skipped: " + ", ".join(c.text(40) for c in skipped[:6]) if skipped else ""
    try:
        chosen, others = _choose(given, launches, ending)
    except ScriptError as err:
        if launches:
            raise
        raise ScriptError(f"{err}: {_last_output(output)}{skipped_text}") from None
    notes = submitted[:_SHOWN_SKIPPED]
    if timed_out or status:
        notes.append(f"after the launch, {Path(given).name} {ending}: {_last_output(output)}")
    return ScriptLaunch(given, chosen, tuple(others + skipped), tuple(notes), envs.get(id(chosen), {}))
