"""The package around the module: one version everywhere, and type stubs that match the built module.
(scripts/test's wheel stage checks the installed package: tests/package/check_installed.py.)"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import sattn

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("SATTN_BINARY_DIR", os.path.join(ROOT, "build"))


def test_one_version_everywhere():
    """CMakeLists.txt's project(VERSION) is the only source: the module, the CLI and pyproject's metadata (read by
    scikit-build-core's regex provider, whose pattern is checked here against the same file) agree."""
    cmake = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    regex = re.search(r"^metadata\.version\.regex = '(.*)'$", pyproject, re.M).group(1)
    assert re.search(r"^metadata\.version\.input = \"CMakeLists.txt\"$", pyproject, re.M)
    version = re.search(regex, cmake).group("value")
    assert re.search(r"project\(sattn VERSION " + re.escape(version), cmake)
    assert sattn.__version__ == version
    cli = os.path.join(BUILD, "sattn")
    if not os.path.exists(cli):
        pytest.skip(f"CLI {cli} not built")
    first = subprocess.run([cli, "version"], check=True, capture_output=True, text=True).stdout.splitlines()[0]
    assert first == f"sattn {version}"


@pytest.mark.skipif(importlib.util.find_spec("pybind11_stubgen") is None,
                    reason="pybind11-stubgen not installed (python/requirements-dev.txt pins it): stubs NOT checked")
def test_stubs_match_the_built_module(tmp_path):
    """python/sattn/_core/*.pyi are what scripts/gen_stubs writes for the built module (run it after changing a
    binding)."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(sattn.__file__)))
    subprocess.run([sys.executable, "-m", "pybind11_stubgen", "sattn._core", "--numpy-array-use-type-var", "-o",
                    str(tmp_path)], check=True, capture_output=True, env=env)
    got_dir = tmp_path / "sattn" / "_core"
    want_dir = os.path.join(ROOT, "python", "sattn", "_core")
    assert sorted(os.listdir(got_dir)) == sorted(os.listdir(want_dir))
    for name in os.listdir(got_dir):
        got = (got_dir / name).read_text()
        want = open(os.path.join(want_dir, name)).read()
        assert got == want, f"python/sattn/_core/{name} is out of date: run scripts/gen_stubs"


def test_package_files():
    pkg = os.path.dirname(sattn.__file__)
    for f in ("py.typed", "_core/__init__.pyi", "_core/sr.pyi", "torch.py"):
        assert os.path.isfile(os.path.join(pkg, f)), f


def test_import_sattn_does_not_import_torch():
    code = "import sys, sattn, sattn.sr; assert 'torch' not in sys.modules, 'torch imported'"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(sattn.__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
