"""Certified Lipschitz bounds of SSoG, lower <= exact <= upper (SPEC S1-S3).

The code lives in lipcheck/commands/certify.py (`lipcheck certify`); this script runs it from a checkout:
`python experiments/certify.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.certify import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
