"""The records ``kvgate eval ruler``, ``eval mc`` and ``eval ppl`` store for gated exports of a
tiny model (an attention, an mlp and a linear gate, each written by ``export_gated`` and read
back by ``--checkpoint``): what a change to the gates, their config, the checkpoint format or
the cache must reproduce (tests/eval/test_gate_records.py).

``python tests/eval/gate_records.py`` rewrites ``data/gate_records.json`` from the code as it
is. It was written before the gate kinds got a config dataclass each (issue #63) and before
``previous_layer`` was removed (#62), so the test shows that those changes moved no stored
number."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "data" / "gate_records.json"
TEXT = ("The grass is green and the sky is blue. Rivers run to the sea and the sea never "
        "fills. Birds fly south when the days grow short, and come back in spring. ") * 3
# gate kind -> (settings, the scale of the output layer drawn at random: a fresh local gate
# keeps everything, so its output weights are drawn large enough that some entries go)
GATES: dict[str, tuple[dict[str, Any], float]] = {
    "attention": ({"kind": "attention", "heads": 2, "head_dim": 8, "gamma": 0.0, "sinks": 1,
                   "recent": 2}, 0.0),
    "mlp": ({"kind": "mlp", "hidden": 16, "gamma": 0.0}, 1.0),
    "linear": ({"kind": "linear", "gamma": 0.0}, 0.5),
}
POLICY = {"attention": "attention_gate", "mlp": "local_gate", "linear": "local_gate"}


def export(base_dir: str, kind: str, out: Path) -> Path:
    """A gated export of ``kind`` on the base in ``base_dir``, its weights seeded."""
    import torch

    from kvgate.checkpoint import export_gated
    from kvgate.gate import GateConfig, gate_modules, patch
    from kvgate.models import load_base, model_fingerprint

    settings, scale = GATES[kind]
    model, _ = load_base(base_dir)
    torch.manual_seed(1)
    patch(model, GateConfig(**settings))
    gates = gate_modules(model)
    if scale:
        with torch.no_grad():
            for gate in gates:
                layer = gate.down if kind == "mlp" else gate.proj
                layer.weight.normal_(0.0, scale)
    return export_gated(model, out, base_model=base_dir,
                        fingerprint=model_fingerprint(model.config),
                        gate_config=gates[0].config)


def runs(checkpoint: Path, policy: str, text: Path, out: Path) -> list[list[str]]:
    """The three command lines run on one export: RULER (two tasks, two examples each), MC
    (COPA, two examples) and perplexity (two windows, masked and cached)."""
    common = ["--checkpoint", str(checkpoint), "--no-progress"]
    if policy == "local_gate":  # a window shorter than the texts, or nothing would go; a
        # round after every decode step, as the records were taken (#65 made 16 the default)
        common += ["--policy-opt", "local_gate.window=4", "--policy-opt", "local_gate.interval=1"]
    others = ["full"]
    if policy == "attention_gate":
        # once: the one-shot policies' shared prefill and KVzip's variants' shared passes
        # (kvgate/cache/shared.py, shared_passes.py) beside the gate
        others = ["full,snapkv,h2o,kvzip,kzp=kvzip", "--policy-opt", "kzp.plus=true",
                  "--budgets", "0.5"]
    return [
        ["eval", "ruler", *common, "--tasks", "niah_single_1,vt", "--lengths", "300",
         "--limit", "2", "--max-new-tokens", "4", "--policies", f"{policy},{others[0]}",
         *others[1:], "--out", str(out / "ruler")],
        ["eval", "mc", *common, "--tasks", "copa", "--limit", "2", "--patterns", "0",
         "--policies", f"full,{policy}", "--out", str(out / "mc")],
        *(["eval", "ppl", *common, "--text-files", str(text), "--context", "40",
           "--continuation", "20", "--windows", "2", "--mode", mode, "--policies", policy,
           "--out", str(out / f"ppl_{mode}")] for mode in ("masked", "cache")),
    ]


def untimed(record: Any) -> Any:
    """A stored record without its timings (seconds, sec_per_example, ...)."""
    if isinstance(record, dict):
        return {k: untimed(v) for k, v in record.items() if "sec" not in k}
    if isinstance(record, list):
        return [untimed(v) for v in record]
    return record


def saved_only(store: Any, reports: Any) -> list[Path]:
    """``kvgate.eval.report.write_outputs`` without results.md and the figures: the records
    are all this compares, and drawing the figures would take most of the test's time."""
    store.save()
    return []


def records(tmp: Path) -> dict[str, dict[str, dict]]:
    """"gate kind / results key" -> uid -> the stored example (timings left out)."""
    from unittest import mock

    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "training")]
    from kvtrain_fixtures import save_tiny_base

    from kvgate.cli import main as kvgate_main

    base_dir = save_tiny_base(tmp / "base", max_position_embeddings=640)
    text = tmp / "text.txt"
    text.write_text(TEXT)
    out: dict[str, dict[str, dict]] = {}
    for kind in GATES:
        checkpoint = export(base_dir, kind, tmp / kind / "gated")
        for argv in runs(checkpoint, POLICY[kind], text, tmp / kind):
            with mock.patch("kvgate.eval.report.write_outputs", saved_only):
                code = kvgate_main(argv)
            if code != 0:
                raise RuntimeError(f"kvgate {' '.join(argv)} exited {code}")
            folder = Path(argv[argv.index("--out") + 1])
            stored = json.loads((folder / "results.json").read_text())["results"]
            for key, rec in stored.items():
                out[f"{kind}/{key}"] = untimed(rec["examples"])
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        got = records(Path(tmp))
    SNAPSHOT.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    print(SNAPSHOT)
