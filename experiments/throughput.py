"""Throughput and peak memory of SSoG against dense attention, 224x224 up to 1024x1024.

The code lives in lipcheck/commands/throughput.py (also reached as a `lipcheck` subcommand); this script runs it
from a checkout: `python experiments/throughput.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.throughput import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
