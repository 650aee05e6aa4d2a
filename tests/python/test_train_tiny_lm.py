"""examples/train_tiny_lm.py --smoke: a tiny language model trained with torch's SDPA and with sattn.torch's from the
same weights on the same batches gives the same per-step losses (1e-3 relative over 20 steps at context 256), also
under torch.set_float32_matmul_precision("high") (sattn's AMX tiles then take float32 as two bf16, forward and
backward)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "train_tiny_lm.py")


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_smoke_losses_match(tmp_path, precision):
    out = tmp_path / "smoke.json"
    # One thread: on a loaded 2-core machine two OpenMP threads per pool make the run 3-4x slower, not faster.
    # The child inherits this process's environment, so PYTHONPATH finds the same sattn module.
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--threads", "1", "--float32-precision", precision,
                           "--json", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert "loss check passed: 20 steps" in proc.stdout, proc.stdout
    assert out.exists() and '"loss_check": "passed"' in out.read_text()
    assert f'"float32_precision": "{precision}"' in out.read_text()
