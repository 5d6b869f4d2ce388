#!/usr/bin/env bash
# #66 on the embedded model: cpt_kvzap's gate exported in KVzap's format, loaded back, and scored
# on RULER's two NIAH families at 2k (24 a family, bf16, teacher-scored, as RESULTS 3) gives the
# same records as the original export.
#   bash experiments/kvzap_roundtrip.sh [OUT]     (trains cpt_kvzap first if its export is missing)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-experiments/results/ruler/kvzap_roundtrip}
[ -f runs/cpt_kvzap/gated/kvgate_config.json ] || {
  kvgate data oracle --config cpt_kvzap
  kvgate train --config cpt_kvzap --ckpt_path last
}
kvgate export runs/cpt_kvzap/gated runs/cpt_kvzap/kvzap --format kvzap --overwrite
args=(--tasks niah_single_1,niah_single_2 --score teacher --dtype bfloat16 --no-progress
      --policies local_gate --lengths 2048 --limit 24)
kvgate eval ruler --checkpoint runs/cpt_kvzap/gated "${args[@]}" --out "$out/kvgate"
kvgate eval ruler --checkpoint runs/cpt_kvzap/kvzap "${args[@]}" --out "$out/kvzap"
python - "$out" <<'EOF'
import json
import sys

out = sys.argv[1]
a, b = (json.load(open(f"{out}/{kind}/results.json"))["results"] for kind in ("kvgate", "kvzap"))
assert a.keys() == b.keys(), (sorted(a), sorted(b))
for key in a:
    ea, eb = a[key]["examples"], b[key]["examples"]
    # sec / timings differ from run to run; every other field of every record must match
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("sec")}
    same = ea.keys() == eb.keys() and all(strip(ea[u]) == strip(eb[u]) for u in ea)
    print(f"{key}: {len(ea)} examples, acc {a[key]['acc']:.1f} / {b[key]['acc']:.1f}, "
          f"evict {a[key]['evict_pct']:.1f}% / {b[key]['evict_pct']:.1f}%: "
          f"{'the same records' if same else 'RECORDS DIFFER'}")
    assert same
EOF
