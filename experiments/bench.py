"""Throughput and peak memory of SSoG against dense attention.

The code lives in lipcheck/commands/bench.py (`lipcheck bench`); this script runs it from a checkout:
`python experiments/bench.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
