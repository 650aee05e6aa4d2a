"""Checks an installed sattn package (scripts/test's wheel stage: a wheel installed into a fresh venv), run from
outside the source tree with no PYTHONPATH, so that only the installed files can be found:
  - `import sattn` loads from the environment's site-packages, with py.typed and the native module's .pyi stubs;
  - sattn.__version__, importlib.metadata.version("sattn") and the `sattn version` command agree;
  - the `sattn` command is in the environment's bin/;
  - one attention call agrees with a plain numpy softmax attention."""
import importlib.metadata
import pathlib
import subprocess
import sys
import sysconfig

import numpy as np

import sattn

pkg = pathlib.Path(sattn.__file__).resolve().parent
site = pathlib.Path(sysconfig.get_path("platlib")).resolve()
assert pkg.parent == site, f"sattn imported from {pkg}, expected the environment's site-packages {site}"
for f in ("py.typed", "_core/__init__.pyi", "_core/sr.pyi"):
    assert (pkg / f).is_file(), f"{f} missing from the installed package {pkg}"

cli = pathlib.Path(sysconfig.get_path("scripts")) / "sattn"
assert cli.is_file(), f"the sattn command is missing from {cli.parent}"
first_line = subprocess.run([str(cli), "version"], check=True, capture_output=True, text=True).stdout.splitlines()[0]
versions = {"sattn.__version__": sattn.__version__, "importlib.metadata": importlib.metadata.version("sattn"),
            "sattn version": first_line.removeprefix("sattn ").strip()}
assert len(set(versions.values())) == 1, f"versions disagree: {versions}"

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 3, 17, 8)).astype(np.float32) for _ in range(3))
out = sattn.scaled_dot_product_attention(q, k, v, is_causal=True)
s = q.astype(np.float64) @ k.swapaxes(-1, -2) / np.sqrt(8) + np.triu(np.full((17, 17), -np.inf), 1)
p = np.exp(s - s.max(-1, keepdims=True))
ref = (p / p.sum(-1, keepdims=True)) @ v
assert np.abs(out - ref).max() < 1e-5, np.abs(out - ref).max()
print(f"installed sattn {sattn.__version__} at {pkg} (numpy {np.__version__}, Python {sys.version.split()[0]}): ok")
