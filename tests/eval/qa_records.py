"""The records ``eval ruler`` and ``eval needle --scoring generate`` store on fixed examples of
a tiny model: what the question-answering runner must reproduce (tests/eval/test_qa_runner.py).

``python tests/eval/qa_records.py`` rewrites ``data/qa_records.json`` from the code as it is;
it was written before the runner replaced the per-benchmark loops, so the test shows that the
refactor changed no stored number."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "data" / "qa_records.json"
RULER_FIELDS = ("output", "score", "kept", "total")
NEEDLE_FIELDS = ("output", "hit", "kept", "total")
POLICIES = ("full", "snapkv", "h2o", "tova", "roco")
FILLER = ["The grass is green. The sky is blue. The sun is yellow. Here we go. Back again.",
          "Rivers run to the sea and the sea never fills. Birds fly south."] * 4


def records(tmp: Path) -> dict[str, dict[str, dict]]:
    """key -> uid -> the stored fields that carry a score or a kept share."""
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "inference")]
    from conftest import build, tiny_llama_config
    from engine_toys import char_tokenizer

    from kvgate.eval.benchmarks.needle.run import evaluate_needle
    from kvgate.eval.benchmarks.ruler.run import evaluate_ruler
    from kvgate.eval.store import ResultStore
    from kvgate.policies import Budget, get_policy

    model = build(tiny_llama_config(max_position_embeddings=640))
    tok = char_tokenizer()
    store = ResultStore(tmp, {"model": "tiny", "checkpoint": None}, flush_s=1e9)
    policies = {name: get_policy(name) for name in POLICIES}
    for aware in (False, True):
        evaluate_ruler(model, tok, ["niah_single_1", "vt", "cwe"], [360],
                       policies, [Budget(ratio=0.5)], store, depths=(0, 50, 100), limit=2,
                       query_aware=aware, max_new_tokens=6, progress=False)
        evaluate_needle(model, tok, FILLER, [260], [0.0, 100.0], policies, [Budget(ratio=0.5)],
                        store, scoring="generate", samples=2, max_new_tokens=4,
                        progress=False, query_aware=aware)
    out = {}
    for key, rec in store.results.items():
        fields = NEEDLE_FIELDS if key.startswith("needle") else RULER_FIELDS
        out[key] = {uid: {f: ex[f] for f in fields} for uid, ex in rec["examples"].items()}
    return out


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        SNAPSHOT.write_text(json.dumps(records(Path(tmp)), indent=1, sort_keys=True) + "\n")
    print(SNAPSHOT)
