"""Every proofs/*.py sympy script checks the algebra of its proof and exits non-zero on failure."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROOFS = Path(__file__).resolve().parents[1] / "proofs"
SCRIPTS = sorted(p.name for p in PROOFS.glob("s*_check.py"))


def test_every_statement_has_a_proof_and_a_check():
    assert SCRIPTS == [f"s{i}_check.py" for i in range(1, 6)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_proof_script(script):
    path = PROOFS / script
    assert path.exists() and (PROOFS / script.replace("_check.py", ".md").upper().replace(".MD", ".md")).exists()
    # the scripts must check this checkout's lipcheck, whatever else is installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROOFS.parent), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                         cwd=PROOFS.parent, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout and out.stdout.count("ok") >= 5
