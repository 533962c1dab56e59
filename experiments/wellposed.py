"""Picard-Lindelof checked on the SSoG Neural-ODE ViT (SPEC S5), contrasted with dense attention.

The code lives in lipcheck/commands/wellposed.py (`lipcheck wellposed`); this script runs it from a checkout:
`python experiments/wellposed.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.common import exit_process  # noqa: E402
from lipcheck.commands.wellposed import main  # noqa: E402

if __name__ == "__main__":
    exit_process(main())
