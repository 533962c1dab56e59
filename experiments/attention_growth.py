"""Attention growth (SPEC S4): certified lower bounds on L(R) for dense attention, the pre-LN block and

The code lives in lipcheck/commands/attention_growth.py (also reached as a `lipcheck` subcommand); this script runs it
from a checkout: `python experiments/attention_growth.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.attention_growth import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
