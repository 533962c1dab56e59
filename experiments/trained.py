"""The three verdicts on trained models: certify (S1-S3), probe (S4), well-posedness (S5).

The code lives in lipcheck/commands/trained.py (also reached as a `lipcheck` subcommand); this script runs it
from a checkout: `python experiments/trained.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.common import exit_process  # noqa: E402
from lipcheck.commands.trained import main  # noqa: E402

if __name__ == "__main__":
    exit_process(main())
