"""Exactness: the default certification of Lip(SSoG) at every ViT token grid: certified gap, seconds, exact where cheap.

The code lives in lipcheck/commands/exactness.py (also reached as a `lipcheck` subcommand); this script runs it
from a checkout: `python experiments/exactness.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.exactness import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
