"""The research policies of experiments/policies, registered for one test (as
experiments/research_cli.py registers them for the command line) and gone after it."""

from __future__ import annotations

import pytest

from experiments.policies import register
from kvgate.policies import registry


@pytest.fixture
def research_policies(monkeypatch):
    """kvgate's registry plus ``gate_hybrid``, for this test only."""
    monkeypatch.setattr(registry, "POLICIES", dict(registry.POLICIES))
    register()
