#!/usr/bin/env bash
# The main job on the embedded defaults (SmolLM2-135M, embedded corpus, CPU):
#   1. set-up (idempotent), then a foundation check: a short generation and the perplexity
#      of the base model on corpus passages;
#   2. train Attention-Gates with configs/cpt_recipe.yaml (the small-compute recipe:
#      distillation, beta schedule, protected tokens) and export the gated checkpoint
#      (runs/cpt_recipe/gated);
#   3. one document compressed once by the full cache, the learned gate and SnapKV at the
#      gate's kept share, each answering the same question asked after compression.
# Extra arguments go to train.py (e.g. --trainer.max_steps 20 for a quick look). A rerun
# resumes the run's newest checkpoint (--ckpt_path last; a killed run goes on where it stopped).
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$KVGATE_ROOT"

python -m kvgate.demo

python train.py --config cpt_recipe --ckpt_path last "$@"

# 3. the same document compressed once by each policy, the question asked after compression
#    (the policy never sees it), through the model's chat template
mkdir -p runs/cpt_recipe
doc=runs/cpt_recipe/demo_context.txt
cat >"$doc" <<'TXT'
The river town grew around a stone bridge built in the twelfth century. Merchants crossed it to
reach the weekly market, and by 1400 the town had a guild hall, two churches and a school. A
great fire in 1666 destroyed most of the wooden houses near the bridge. The town was rebuilt
in brick, and the new houses along the river still stand today.
TXT
question="What destroyed the houses near the bridge?"

summary() {  # one line per policy: the answer, kept share and bytes held
python - "$1" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[2]))
s = d["stats"]
# bytes held count the ragged cache's per-entry positions too, so the full cache's exceed dense
print(f"{sys.argv[1]:<14} kept {100 * s['kept_fraction']:5.1f}% of the context KV, "
      f"{s['bytes_held']:,} bytes held (K/V + positions) of {s['bytes_full']:,} dense | "
      f"{d['answers'][0].strip()}")
PY
}

echo
echo "== Q: $question (asked after compression)"
python infer.py --checkpoint runs/cpt_recipe/gated --context-file "$doc" --question "$question" \
    --max-new-tokens 24 --json >runs/cpt_recipe/infer_gate.json
budget=$(python -c "import json; print(round(json.load(open('runs/cpt_recipe/infer_gate.json'))['stats']['kept_fraction'], 4))")
python infer.py --model smollm2-135m --policy full --context-file "$doc" \
    --question "$question" --max-new-tokens 24 --json >runs/cpt_recipe/infer_full.json
python infer.py --model smollm2-135m --policy snapkv --budget "$budget" --context-file "$doc" \
    --question "$question" --max-new-tokens 24 --json >runs/cpt_recipe/infer_snapkv.json
summary "full cache" runs/cpt_recipe/infer_full.json
summary "learned gate" runs/cpt_recipe/infer_gate.json
summary "snapkv" runs/cpt_recipe/infer_snapkv.json
