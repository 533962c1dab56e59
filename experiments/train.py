"""Train SSoG / attention ViTs, and the matched SSoG-vs-attention comparison on scikit-learn digits.

The code lives in lipcheck/commands/train.py (also reached as a `lipcheck` subcommand); this script runs it
from a checkout: `python experiments/train.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.common import exit_process  # noqa: E402
from lipcheck.commands.train import main  # noqa: E402

if __name__ == "__main__":
    exit_process(main())
