"""`shardkit launch --backend xla`: run a script on every XLA device through torch_xla.launch.

    python -m shardkit_backends.xla.launch --nproc N [--] script.py [script args]

torch_xla's launcher is a Python call, not a program: `torch_xla.launch(fn)` runs `fn` once per
device (a thread per device on CPU, a process per chip on TPU) and sets the ordinals that
`shardkit.init()` reads through torch_xla.runtime. Here `fn` runs the script as `__main__`. On CPU,
--nproc sets CPU_NUM_DEVICES; on TPU the devices are the chips there are (torch_xla decides).
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

from .spawn import child_environment


def _run_script(index: int, script: str, argv: list[str]) -> None:
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def parse(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """Split our argv into --nproc and the script's argv; torchrun-only options are refused."""
    args = list(argv)
    nproc = None
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt == "--":
            break
        name, _, value = opt.partition("=")
        if name in ("--nproc", "--nproc-per-node", "--nproc_per_node"):
            nproc = int(value if value else args.pop(0))
        else:
            raise SystemExit(f"shardkit launch --backend xla: option {opt!r} is a torchrun option; "
                             "torch_xla's launcher takes only --nproc (on TPU pods, run the same "
                             "command on every host)")
    if not args:
        raise SystemExit("usage: python -m shardkit_backends.xla.launch --nproc N script.py [args]")
    return nproc, args


def main(argv: Sequence[str] | None = None) -> None:
    """Run the script on every XLA device."""
    nproc, script_argv = parse(sys.argv[1:] if argv is None else argv)
    if nproc is not None:
        os.environ.update(child_environment(int(nproc), dict(os.environ)))
    os.environ["SHARDKIT_BACKEND"] = "xla"
    import torch_xla

    torch_xla.launch(_run_script, args=(script_argv[0], script_argv[1:]))


if __name__ == "__main__":
    main()
