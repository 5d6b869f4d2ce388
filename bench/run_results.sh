#!/usr/bin/env bash
# Reproduces the runs behind docs/RESULTS.md (CPU, SmolLM2-135M, embedded data). Each step is
# resumable: trainings resume from their last.ckpt only if you pass --ckpt_path last by hand,
# and evaluations skip keys already in their results.json. Two queues can run side by side
# (OMP_NUM_THREADS=1 each) on a 2-core machine: `bash bench/run_results.sh sft` and `... eval`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
TASKS7=piqa,arc_easy,arc_challenge,rte,copa,boolq,hellaswag
HEUR=full,streaming,window,h2o,tova,snapkv,adakv,nacl,ahakv

case "${1:-all}" in
  base)   # every heuristic at 50 % on the base model (7 tasks, masked mode)
    python -m kvgate.eval mc --model smollm2-135m --tasks $TASKS7 --limit 30 \
      --policies $HEUR --budgets 0.5 --mode masked --no-progress --out results/mc_base_050 ;;
  cpt)    # CPT: paper recipe (gates + LoRA) and the small-compute recipe (gates only)
    python train.py --config cpt_demo
    python train.py --config cpt_recipe ;;
  sft)    # SFT: gates + LoRA vs LoRA only on RTE and COPA
    for c in sft_demo_rte sft_demo_rte_lora sft_demo_copa sft_demo_copa_lora; do
      python train.py --config $c
    done ;;
  *) echo "usage: $0 base|cpt|sft" >&2; exit 2 ;;
esac
