"""What every command shares: grid and count arguments checked by argparse, the thread count, the options of a
run on a checkpoint, and the one error path for bad input (one line, the command's prefix, exit status 2)."""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

_GRID = re.compile(r"^\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*$")


def grid(text: str) -> tuple[int, int]:
    """`14x14` or `14` (square) -> (14, 14); anything else is an argparse error (exit 2, the command's prefix)."""
    m = _GRID.match(text)
    if not m or int(m.group(1)) <= 0 or (m.group(2) is not None and int(m.group(2)) <= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a token grid: write HxW with positive integers, "
                                         f"e.g. 14x14 (a 224x224 image in 16x16 patches)")
    H = int(m.group(1))
    return H, int(m.group(2)) if m.group(2) is not None else H


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return v


def set_threads(n: int | None):
    """torch's threads and every BLAS / OpenMP pool scipy and numpy bring (lipcheck.threads) to n (None: torch's
    current count); returns the handle that restores them."""
    import torch

    from .. import threads
    return threads.set_threads(torch.get_num_threads() if n is None else n)


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None, help="also write the numbers to this path")
    p.add_argument("--docs", type=Path, default=None,
                   help="where the report goes (default: the checkout's docs/, or ./lipcheck-reports when installed; "
                        "with --checkpoint RUN/verdicts/; a --quick run writes to <docs>/quick/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_checkpoint_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--checkpoint", metavar="RUN", help=f"a `lipcheck train` checkpoint or its run directory: {what}; "
                   "the report goes to RUN/verdicts/ unless --docs says otherwise")
    p.add_argument("--data", choices=("digits", "cifar100"),
                   help="with --checkpoint: images from this data set (default: the one the model was trained on)")
    p.add_argument("--data-dir", help="with --checkpoint: directory holding cifar-100-python/ (CIFAR-100 models)")
    p.add_argument("--images", type=positive_int, default=None,
                   help="how many test images (default: 2 with --quick, 4 otherwise); without --checkpoint, with "
                        "--enclosure-only: how many random images of the preset, each enclosed on its own (default 1)")


def not_with_checkpoint(args, parser: argparse.ArgumentParser, defaults: dict) -> None:
    """Options that describe the randomly initialised model a command builds itself have no meaning on a
    checkpoint, whose model is the checkpoint's: say so instead of ignoring them."""
    for name, default in defaults.items():
        if getattr(args, name) != default:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(fail(parser.prog, f"{flag} sets up the model this command builds; with --checkpoint the "
                                               f"model is the checkpoint's: drop {flag}"))


def fail(prog: str, err: Exception) -> int:
    """Bad input found after parsing: one line naming the fix, exit status 2, nothing written."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return 2


def parse(module, argv, prog: str | None = None):
    """A command's own parser (as `lipcheck <command>` builds it) on argv: experiments/*.py and tests use this."""
    p = argparse.ArgumentParser(prog=prog, description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    return p.parse_args(argv), p


def exit_process(rc: int | None) -> None:
    """Leave with exit status rc. Under torchrun (WORLD_SIZE > 1), once the output is flushed, without the
    interpreter's teardown: after the process group is destroyed, a gloo thread can still abort the normal exit
    ("terminate called without an active exception", SIGABRT) of a rank that finished its work, as in a few of
    many CI runs; every file a command writes is closed before it returns."""
    rc = 0 if rc is None else int(rc)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    raise SystemExit(rc)


def work_budget(args) -> dict:
    """enclose's max_work from --max-work: the library's default when not given, None (no budget) for inf."""
    if getattr(args, "max_work", None) is None:
        return {}
    return {"max_work": None if math.isinf(args.max_work) else args.max_work}
