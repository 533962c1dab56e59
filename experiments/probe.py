"""Dense attention's local Lipschitz growth, certified lower bounds on adversarial inputs (SPEC S4).

The code lives in lipcheck/commands/probe.py (`lipcheck probe`); this script runs it from a checkout:
`python experiments/probe.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout runs without installing

from lipcheck.commands.probe import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
