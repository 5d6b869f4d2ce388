"""A learned gate's threshold for a target eviction ratio, measured on given contexts.

A learned gate keeps what its scores put above the threshold ``tau`` (KVzap, arXiv:2601.07891,
serves its gate this way; the Attention-Gate, arXiv:2410.12876, trains with one), so how much
it evicts follows the text and its length, not a budget: the same tau can evict 70% of a
1k-token context and 78% of a 4k one. To compare a gate with budgeted policies at a given
ratio, or to serve it at one, the threshold is found on contexts like the ones it will see.

:func:`fit_taus` searches tau in (0, 1) for each target share, on a function that measures the
evicted share at a tau (a higher tau evicts more); :func:`evicted_share` is that function for
a policy with a ``tau`` option over real contexts (each compressed alone, as ``Engine.compress``
does, its share of entries evicted averaged over the contexts).

Progress (``kvgate.progress``) counts compressions: at most ``max_runs`` measurements of every
context per target, the runs a search did not need dropped from the total when it ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.policies.base import Policy, PolicyError
from kvgate.progress import Progress


@dataclass(frozen=True)
class TauFit:
    """The threshold found for one target share of entries evicted."""

    target: float  # evicted share asked, in (0, 1)
    tau: float  # the measured threshold whose share is closest to target
    evicted: float  # the share measured at tau
    runs: int  # measurements made for this target (those shared with other targets included)
    tol: float  # the tolerance it searched to

    @property
    def reached(self) -> bool:
        return abs(self.evicted - self.target) <= self.tol


def fit_taus(evicted: Callable[[float], float], targets: Sequence[float], tol: float = 0.01,
             max_runs: int = 10, ended: Callable[[TauFit], None] | None = None
             ) -> list[TauFit]:
    """One :class:`TauFit` per target (in the order given).

    The search brackets each target between the measured thresholds around it (tau 0 counts
    as evicting nothing, tau 1 everything) and alternates a linear interpolation inside the
    bracket with its midpoint, so a smooth share converges in a few runs and any monotone one
    at least halves the bracket every second run. Measurements are shared across targets.
    A target the gate cannot reach (its sinks and recent window always stay) ends at the
    closest share measured, with ``reached`` false. ``ended`` is told each fit as its search
    ends.
    """
    for t in targets:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t < 1.0:
            raise PolicyError(f"a target evicted share must be a number in (0, 1), got {t!r}")
    if not 0.0 < tol < 1.0:
        raise PolicyError(f"tol must lie in (0, 1), got {tol!r}")
    if max_runs < 1:
        raise PolicyError(f"max_runs must be >= 1, got {max_runs!r}")
    seen: dict[float, float] = {}

    def measure(tau: float) -> float:
        if tau not in seen:
            seen[tau] = float(evicted(tau))
        return seen[tau]

    fits = {}
    for target in sorted({float(t) for t in targets}):
        runs = 0
        while runs < max_runs:
            best = _closest(seen, target)
            if best is not None and abs(seen[best] - target) <= tol:
                break
            hi = min((t for t, e in seen.items() if e >= target), default=1.0)
            lo = max((t for t, e in seen.items() if e < target and t < hi), default=0.0)
            e_lo, e_hi = seen.get(lo, 0.0), seen.get(hi, 1.0)
            tau = (lo + hi) / 2
            if runs % 2 == 0 and e_hi > e_lo:
                tau = lo + (target - e_lo) / (e_hi - e_lo) * (hi - lo)
                tau = min(max(tau, lo + 0.05 * (hi - lo)), hi - 0.05 * (hi - lo))
            if tau in seen or not lo < tau < hi:  # the bracket is exhausted in floating point
                break
            measure(tau)
            runs += 1
        best = _closest(seen, target)
        fits[target] = TauFit(target, best, seen[best], runs, tol)
        if ended is not None:
            ended(fits[target])
    return [fits[float(t)] for t in targets]


def _closest(seen: dict[float, float], target: float) -> float | None:
    return min(seen, key=lambda t: (abs(seen[t] - target), t), default=None)


def with_tau(policy: Policy, tau: float) -> Policy:
    """A copy of ``policy`` at threshold ``tau`` (validated as the policy validates it)."""
    fields = {f.name for f in dataclasses.fields(policy)} if dataclasses.is_dataclass(policy) \
        else set()
    if "tau" not in fields:
        raise PolicyError(f"policy {policy.name} has no threshold (tau) to calibrate: only "
                          "learned gates do (attention_gate, local_gate)")
    return dataclasses.replace(policy, tau=tau)


def evicted_share(model: Any, tokenizer: Any, policy: Policy, contexts: Sequence[str],
                  chat: bool = True, progress: Progress | None = None) -> float:
    """Mean over ``contexts`` of the share of context entries (all layers and KV heads)
    ``policy`` evicts when the context is compressed alone (``progress``: a step each)."""
    from kvgate.inference.engine import Engine

    if not contexts:
        raise PolicyError("calibration needs at least one context")
    engine = Engine(model, tokenizer, policy, budget=1.0)  # a gate's threshold decides, not it
    shares = []
    for text in contexts:
        shares.append(1.0 - engine.compress(text, chat=chat).kept_fraction)
        if progress is not None:
            progress.advance(note=f"{policy.name} at tau {getattr(policy, 'tau', 0.0):.4f}")
    return sum(shares) / len(shares)


def calibrate(model: Any, tokenizer: Any, policy: Policy, contexts: Sequence[str],
              targets: Sequence[float], tol: float = 0.01, max_runs: int = 10,
              chat: bool = True, progress: Progress | None = None) -> list[TauFit]:
    """``policy``'s threshold for each target evicted share over ``contexts``; ``progress``
    counts compressions, ``len(set(targets)) * max_runs * len(contexts)`` at most."""
    with_tau(policy, 0.5)  # refuse a policy without a threshold before any run

    def ended(fit: TauFit) -> None:
        if progress is not None:
            progress.drop((max_runs - fit.runs) * len(contexts))

    return fit_taus(lambda tau: evicted_share(model, tokenizer, with_tau(policy, tau), contexts,
                                              chat, progress), targets, tol, max_runs, ended)
