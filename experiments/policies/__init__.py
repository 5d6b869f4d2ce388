"""Research policies kept out of the kvgate package, for the tables of docs/RESULTS.md measured
with them. ``register()`` adds each to kvgate's registry (``kvgate.policies.register_policy``);
``experiments/research_cli.py`` calls it before it runs the ``kvgate`` command line. Importing
this package registers nothing, so a test chooses when (and undoes it)."""

from __future__ import annotations


def register() -> None:
    """Add every research policy to kvgate's registry (again: nothing changes)."""
    from experiments.policies.gate_hybrid import GateHybrid
    from kvgate.policies import register_policy

    register_policy("gate_hybrid", GateHybrid)
