"""Shared pytest setup: the repository root on sys.path (so ``tests.*`` modules import in
spawned workers) and the multi-process harness shut down at the end of the session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker: a keyword would match a directory named gpu
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _harness_pools():
    """Stop the harness's worker processes when the session ends."""
    yield
    from tests.harness import shutdown_pools

    shutdown_pools()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One token cache for every trainer test of the session (the corpus is tokenized once)."""
    return tmp_path_factory.mktemp("token-cache")
