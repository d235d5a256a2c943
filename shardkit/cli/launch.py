"""`shardkit launch`: start a training script on N ranks through the backend's launcher (torchrun by default).

    shardkit launch [--backend NAME] [--nproc N] [torchrun options] script.py [script args]

shardkit starts no processes itself: it picks the backend, asks it for the launcher command
(`Backend.launch_command`), exports SHARDKIT_BACKEND so every rank's `shardkit.init()` agrees,
and replaces itself with that command. Everything after the script goes to the script untouched.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import ShardkitError
from .args import ENVIRONMENT_HELP

USAGE = ("usage: shardkit launch [--backend NAME] [--nproc N] [--dry-run] [torchrun options] "
         "script.py [script args]")
HELP = f"""{USAGE}

Start script.py on N ranks per node with the backend's launcher (torchrun for cpu, cuda, xpu).

shardkit options:
  --backend NAME       backend every rank uses (default: SHARDKIT_BACKEND, else the best available)
  --nproc N            ranks per node (default: the backend's device count, 1 on cpu);
                       also accepted as --nproc-per-node / --nproc_per_node
  --dry-run            print the command and environment instead of running them
  -v, -vv              every rank logs what shardkit decides (SHARDKIT_LOG=info; -vv: debug)
  -h, --help           this help

Any other option before the script is a torchrun option and is passed through, e.g.
  --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500
(see: python -m torch.distributed.run --help). Arguments after the script go to the script.
OMP_NUM_THREADS, unless set, becomes the usable cores divided by the ranks per node.

{ENVIRONMENT_HELP}
"""
NPROC_FLAGS = ("--nproc", "--nproc-per-node", "--nproc_per_node")


@dataclass
class LaunchRequest:
    """The command line split into shardkit's options, the launcher's, and the script's."""

    backend: str | None = None
    nproc: str | None = None
    dry_run: bool = False
    help: bool = False
    verbose: int = 0
    launcher_args: list[str] = field(default_factory=list)
    script_argv: list[str] = field(default_factory=list)


def _torchrun_value_options() -> dict[str, bool]:
    """Map each torchrun option string to whether it takes a value (from torchrun's own parser)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    return {opt: action.nargs != 0 for action in parser._actions for opt in action.option_strings}


def split_argv(argv: Sequence[str]) -> LaunchRequest:
    """Split `argv` at the script: shardkit options, torchrun options (with their values), script and args."""
    req = LaunchRequest()
    known: dict[str, bool] = {}  # torchrun's options, read (importing torch) only when one appears
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--":
            req.script_argv = args[i + 1:]
            break
        if not token.startswith("-") or token == "-":
            req.script_argv = args[i:]
            break
        name, has_inline, inline = token.partition("=")
        if name in ("-h", "--help"):
            req.help = True
            i += 1
            continue
        if name == "--dry-run":
            req.dry_run = True
            i += 1
            continue
        if name in ("-v", "-vv", "--verbose"):  # shardkit's, as in `shardkit -v launch`
            req.verbose += 2 if name == "-vv" else 1
            i += 1
            continue
        if name in ("--backend", *NPROC_FLAGS):
            if has_inline:
                value = inline
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 1
            else:
                raise ShardkitError(f"{name} needs a value")
            if name == "--backend":
                req.backend = value
            else:
                req.nproc = value
            i += 1
            continue
        known = known or _torchrun_value_options()
        if name not in known:
            raise ShardkitError(f"unknown launcher option {name!r}. shardkit launch takes its own "
                                "options (--backend, --nproc, --dry-run) and torchrun's "
                                "(python -m torch.distributed.run --help) before the script")
        req.launcher_args.append(token)
        if known[name] and not has_inline:
            if i + 1 >= len(args):
                raise ShardkitError(f"launcher option {name} needs a value")
            req.launcher_args.append(args[i + 1])
            i += 1
        i += 1
    return req


def build_command(req: LaunchRequest) -> tuple[list[str], dict[str, str]]:
    """Resolve the backend and return (command, environment additions) for the request."""
    from ..backend import check_local_ranks
    from ..job.selection import get_backend

    if not req.script_argv:
        raise ShardkitError(f"no training script given.\n{USAGE}")
    backend = get_backend(req.backend)
    nproc = req.nproc
    if nproc is None:
        limit = backend.max_local_ranks()
        nproc = "1" if limit is None else str(max(limit, 1))
    if not nproc.isdigit() or int(nproc) < 1:
        raise ShardkitError(f"--nproc must be a positive integer, got {nproc!r}")
    check_local_ranks(backend, int(nproc))
    command = backend.devices.launch_command(nproc, req.launcher_args, req.script_argv)
    env = {"SHARDKIT_BACKEND": backend.name, **thread_env(int(nproc), os.environ)}
    if req.verbose:
        env["SHARDKIT_LOG"] = "info" if req.verbose == 1 else "debug"
    return command, env


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under taskset or a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_env(nproc: int, environ: Mapping[str, str], cores: int | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS for each rank: the user's if set, else the usable cores split among the ranks.

    torchrun would set 1 and print a five-line banner on every launch; splitting the cores keeps
    a CPU job from both oversubscribing and leaving cores idle.
    """
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (cores or usable_cores()) // nproc))}


def check_script(req: LaunchRequest) -> None:
    """Refuse a script that does not exist: torchrun would start every rank only to have each fail on it."""
    runs_a_module = any(arg.split("=")[0] in ("-m", "--module", "--no-python", "--no_python")
                        for arg in req.launcher_args)
    if not runs_a_module and not os.path.isfile(req.script_argv[0]):
        raise ShardkitError(f"no such script: {req.script_argv[0]}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run `shardkit launch`; returns an exit status (only when not replaced by the launcher)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        req = split_argv(argv)
        if req.help:
            print(HELP)
            return 0
        command, extra_env = build_command(req)
        if not req.dry_run:  # --dry-run only shows what would run
            check_script(req)
    except ShardkitError as exc:
        print(f"shardkit launch: error: {exc}", file=sys.stderr)
        return 2
    if req.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in extra_env.items()), shlex.join(command))
        return 0
    if "OMP_NUM_THREADS" in extra_env:
        print(f"shardkit launch: OMP_NUM_THREADS={extra_env['OMP_NUM_THREADS']} per rank "
              f"({usable_cores()} usable cores; set OMP_NUM_THREADS to choose)", file=sys.stderr)
    from ..job.parent_death import PARENT_PID_ENV

    # exec keeps this pid: the launcher's ranks see it as their parent and end with it.
    env = {**os.environ, **extra_env, PARENT_PID_ENV: str(os.getpid())}
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        # Become the launcher: signals, exit status and terminal behave exactly as under torchrun.
        os.execvpe(command[0], command, env)
    import subprocess

    return subprocess.call(command, env=env)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `shardkit launch`; its arguments are split by split_argv, since torchrun's are open-ended."""
    # prefix_chars="+" makes argparse treat every token as positional, so torchrun options and the
    # script's own options reach split_argv untouched; -h/--help is handled there too.
    parser = subparsers.add_parser("launch", help="start a script on N ranks (torchrun underneath)",
                                   add_help=False, prefix_chars="+")
    parser.add_argument("argv", nargs="*")
    parser.set_defaults(run=lambda args: main(args.argv))


if __name__ == "__main__":
    sys.exit(main())
