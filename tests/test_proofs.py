"""Every proofs/*.py sympy script checks the algebra of its proof and exits non-zero on failure."""
import subprocess
import sys
from pathlib import Path

import pytest

PROOFS = Path(__file__).resolve().parents[1] / "proofs"
MINE = ["s1_check.py", "s2_check.py", "s3_check.py"]


@pytest.mark.parametrize("script", MINE)
def test_proof_script(script):
    path = PROOFS / script
    assert path.exists() and (PROOFS / script.replace("_check.py", ".md").upper().replace(".MD", ".md")).exists()
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300,
                         cwd=PROOFS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout and out.stdout.count("ok") >= 5
