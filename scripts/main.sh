#!/usr/bin/env bash
# The main job on the embedded defaults (SmolLM2-135M, embedded corpus, CPU):
#   1. set-up (idempotent), then a foundation check: a short generation and the perplexity
#      of the base model on corpus passages;
#   2. train Attention-Gates with configs/cpt_recipe.yaml (the small-compute recipe:
#      distillation, beta schedule, protected tokens) and export the gated checkpoint
#      (runs/cpt_recipe/gated);
#   3. gated generation from that checkpoint with its stats table, next to SnapKV at the same
#      kept share of the prompt.
# Extra arguments go to train.py (e.g. --trainer.max_steps 20 for a quick look).
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$KVGATE_ROOT"

python -m kvgate.demo

python train.py --config cpt_recipe "$@"

prompt="The river town grew around a stone bridge built in the twelfth century. Merchants \
crossed it to reach the weekly market, and by 1400 the town had a guild hall, two churches \
and a school. A great fire in 1666 destroyed most of the wooden houses near the bridge. \
Question: What destroyed the houses near the bridge? Answer:"

echo
echo "== learned gate (attention_gate) from runs/cpt_recipe/gated"
python infer.py --checkpoint runs/cpt_recipe/gated --prompt "$prompt" --max-new-tokens 24 \
    --json >runs/cpt_recipe/infer_gate.json
python - <<'PY'
import json
d = json.load(open("runs/cpt_recipe/infer_gate.json"))
print(d["texts"][0].strip())
s = d["stats"]
print(f"kept {100 * s['kept_fraction']:.1f}% of the prompt KV, {s['bytes_held']:,} of "
      f"{s['bytes_full']:,} bytes, prefill {s['prefill_ms']:.0f} ms, "
      f"decode {s['decode_tokens_per_s']:.1f} tokens/s")
PY
budget=$(python -c "import json; print(round(json.load(open('runs/cpt_recipe/infer_gate.json'))['stats']['kept_fraction'], 4))")
echo
echo "== snapkv at the gate's kept share ($budget)"
python infer.py --model smollm2-135m --policy snapkv --budget "$budget" --prompt "$prompt" \
    --max-new-tokens 24
