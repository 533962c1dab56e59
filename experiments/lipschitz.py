"""Certify: Lipschitz bounds for fixed-kernel SSoG, the block and the Neural-ODE vector field (S1-S3).

The code lives in lipcheck/commands/lipschitz.py (also reached as a `lipcheck` subcommand); this script runs it
from a checkout: `python experiments/lipschitz.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.lipschitz import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
