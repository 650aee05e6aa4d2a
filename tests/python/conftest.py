"""Shared pytest fixtures."""
import pytest

import sattn


@pytest.fixture(scope="module")
def one_thread():
    """Sweeps of tiny problems: on a loaded 2-core machine OpenMP threads only add waiting. Thread-count
    independence is tested in test_core.py."""
    sattn.set_num_threads(1)
    yield
    sattn.set_num_threads(None)
