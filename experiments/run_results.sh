#!/usr/bin/env bash
# Reproduces the runs behind docs/RESULTS.md and the log in experiments/LOG.md (CPU,
# SmolLM2-135M, embedded data): `bash experiments/run_results.sh STEP [ARGS]`, the steps below.
# Each step is resumable: trainings resume from their last.ckpt only if you pass --ckpt_path
# last by hand, and evaluations skip keys already in their results.json (experiments/results
# keeps per-example records only where docs/RESULTS.md pairs them: a step rerun into a folder
# whose records were dropped scores them again). Two queues can run side by side
# (OMP_NUM_THREADS=1 each) on a 2-core machine: `bash experiments/run_results.sh sft` and
# `... eval`.
# The variant configs in experiments/configs set no output folder: every training of one passes
# --run_dir runs/abl_<variant> (`variant` below), the folder its config was named after.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
TASKS7=piqa,arc_easy,arc_challenge,rte,copa,boolq,hellaswag
R=experiments/results   # every evaluation writes a folder here
C=experiments/configs   # the variant configs, layered on cpt_recipe
# kvgate with the research policies of experiments/policies registered (gate_hybrid, which
# tables of docs/RESULTS.md were measured with); kvgate's own command line otherwise
kvgate() { python experiments/research_cli.py "$@"; }
# the 128 held-out 256 + 256-token windows every 256-token gate and heuristic is scored on
WIN256=(--docs 2000 --context 256 --continuation 256 --windows 128 --no-progress)

# gate_vs_best_heuristics CKPT OUT: a gate on the 7 tasks (1,300 examples) beside H2O and TOVA
# at its per-example budgets in OUT, and RoCo (cache mode, the gate re-run in cache mode) in
# OUT_b, a folder of its own so it can run beside the rest
gate_vs_best_heuristics() {
  local mc=(--checkpoint "$1" --tasks $TASKS7 --limit 200 --no-progress)
  kvgate eval mc "${mc[@]}" --policies attention_gate --mode masked --out "$2"
  kvgate eval matched "${mc[@]}" --policies h2o,tova --mode masked --out "$2"
  kvgate eval matched "${mc[@]}" --policies roco --mode cache --out "${2}_b"
  python experiments/summarize_mc.py "$2" "${2}_b" $R/mc_short_full --paired attention_gate
}
# a gate with a LoRA adapter: full and heuristics on the adapted model (gates open / adapter
# on), and on the frozen base as the training-free heuristics are used (CKPT OUT POLICIES)
lora_gate_vs_heuristics() {
  local mc=(--checkpoint "$1" --tasks $TASKS7 --limit 200 --no-progress --mode masked)
  kvgate eval mc "${mc[@]}" --policies attention_gate,full --out "$2"
  kvgate eval matched "${mc[@]}" --policies "$3" --out "$2"
  kvgate eval matched "${mc[@]}" --policies h2o,tova --others-on base --out "${2}_base"
  python experiments/summarize_mc.py "$2" $R/mc_headroom_a $R/mc_short_full \
    --paired attention_gate --any-mode
  python experiments/summarize_mc.py "${2}_base" --paired attention_gate
}
# a gate and the heuristics at its budgets on the 7 tasks split over two folders (OUT, OUT_b)
# that can run side by side, pooled beside H2O at fixed budgets and the full cache
# (CKPT OUT POLICIES)
matched_split() {
  local mc=(--checkpoint "$1" --limit 200 --no-progress --mode masked --policies "$3")
  kvgate eval matched "${mc[@]}" --tasks piqa,arc_easy,arc_challenge,copa --out "$2"
  kvgate eval matched "${mc[@]}" --tasks rte,boolq,hellaswag --out "${2}_b"
  python experiments/summarize_mc.py "$2" "${2}_b" $R/mc_headroom_a $R/mc_short_full \
    --paired attention_gate --any-mode --merge
}
# kept_ratios RESULTS_JSON...: the kept ratios the gates in those records reached, rounded to
# 0.01 and comma-joined (a heuristic's budget is a kept ratio)
kept_ratios() {
  python - "$@" <<'PY'
import json, sys
kept = {round(1 - rec["evict_pct"] / 100, 2)
        for f in sys.argv[1:] for rec in json.load(open(f))["results"].values()}
print(",".join(f"{k:.2f}" for k in sorted(kept)))
PY
}
# ctx256_beta_gate VARIANT SEED: experiments/configs/recent64_256_<VARIANT>.yaml layered on
# recent64_256 as seed SEED (0: runs/abl_recent64_256_VARIANT, k: ..._seed<k>), scored at keep
# thresholds 0.5 and 0.56 over ctx256seed's 128 windows, H2O at every eviction it reaches and
# SnapKV, StreamingLLM and random masks at the as-trained ones
ctx256_beta_gate() {
  local variant=$1 seed=$2 sfx=
  [ "$seed" = 0 ] || sfx=_seed$seed
  local name=abl_recent64_256_$variant$sfx out=$R/ppl_ctx256
  local run=runs/$name
  seed_run "$run" "$seed" --config cpt_recipe --config $C/recent64_256.yaml \
    --config "$C/recent64_256_$variant.yaml"
  kvgate eval ppl --checkpoint "$run/gated" --policies attention_gate "${WIN256[@]}" \
    --out "$out/gate_$name"
  local gates=()
  gate_taus "$name" 56
  kvgate eval ppl --model smollm2-135m --policies h2o --budgets "$(kept_ratios \
    "$out/gate_$name/results.json" "${gates[@]}")" "${WIN256[@]}" --out "$out/heuristics"
  kvgate eval ppl --model smollm2-135m --policies snapkv,streaming,random \
    --budgets "$(kept_ratios "$out/gate_$name/results.json")" "${WIN256[@]}" --out "$out/heuristics"
  python experiments/summarize_ablation.py "$out"
}
# gate_taus NAME TAU...: the gate of runs/NAME at keep thresholds 0.TAU over ctx256seed's 128
# windows, each in experiments/results/ppl_ctx256/gate_NAME_tauTAU; appends those results.json
# to `gates`
gate_taus() {
  local name=$1 tau out=$R/ppl_ctx256; shift
  for tau in "$@"; do
    kvgate eval ppl --checkpoint "runs/$name/gated" \
      --policies "gate_tau$tau=attention_gate" --policy-opt "gate_tau$tau.tau=0.$tau" \
      "${WIN256[@]}" --out "$out/gate_${name}_tau$tau"
    gates+=("$out/gate_${name}_tau$tau/results.json")
  done
}
# beta_curve VARIANT "TAU..." SEED...: the recent64_256_VARIANT gates of those seeds at the
# keep thresholds (gate_taus), then H2O at every eviction they reach, then the summary
beta_curve() {
  local variant=$1 taus=$2 seed sfx gates=(); shift 2
  [ $# -gt 0 ] || { echo "curve256$variant: name at least one SEED" >&2; exit 2; }
  for seed in "$@"; do
    sfx=; [ "$seed" = 0 ] || sfx=_seed$seed
    # shellcheck disable=SC2086  # taus is a list
    gate_taus "abl_recent64_256_$variant$sfx" $taus
  done
  kvgate eval ppl --model smollm2-135m --policies h2o \
    --budgets "$(kept_ratios "${gates[@]}")" "${WIN256[@]}" --out $R/ppl_ctx256/heuristics
  python experiments/summarize_ablation.py $R/ppl_ctx256
}
# variant NAME ARGS...: kvgate train ARGS with every output under runs/NAME
variant() {
  local name=$1; shift
  kvgate train "$@" --run_dir "runs/$name"
}
# seed_run RUN SEED ARGS...: kvgate train ARGS as seed SEED with every output under RUN,
# unless RUN already has its export; `--ckpt_path last` resumes from the run's newest valid
# checkpoint (a fresh run says it starts from step 0)
seed_run() {
  local run=$1 seed=$2; shift 2
  [ -f "$run/gated/kvgate_config.json" ] && return 0
  kvgate train "$@" --seed_everything "$seed" --run_dir "$run" --ckpt_path last
}
# ctx_windows CONTEXT: sets `win` to the windows of that context's seed table
ctx_windows() {
  case "$1" in
    256) win=("${WIN256[@]}") ;;
    1024) win=(--docs 4000 --context 1024 --continuation 1024 --windows 64 --no-progress) ;;
    *) echo "CONTEXT is 256 or 1024, got $1" >&2; exit 2 ;;
  esac
}
# ctx1024_score NAME HEURISTICS: the gate of runs/NAME and HEURISTICS at its eviction over the
# 64 held-out 1,024 + 1,024-token windows of the 1,024-token seed table, then the summary
ctx1024_score() {
  local name=$1 heur=$2 out=$R/ppl_ctx1024 win=()
  ctx_windows 1024
  kvgate eval ppl --checkpoint "runs/$name/gated" --policies attention_gate \
    "${win[@]}" --out "$out/gate_$name"
  kvgate eval ppl --model smollm2-135m --policies "$heur" \
    --budgets "$(kept_ratios "$out/gate_$name/results.json")" "${win[@]}" --out "$out/heuristics"
  python experiments/summarize_ablation.py "$out"
}
# ctx1024_gate NAME SEED HEURISTICS ARGS...: train.py ARGS as seed SEED into runs/NAME
# (seed_run), then ctx1024_score NAME HEURISTICS
ctx1024_gate() {
  local name=$1 seed=$2 heur=$3; shift 3
  seed_run "runs/$name" "$seed" "$@"
  ctx1024_score "$name" "$heur"
}
# gate_select CONTEXT NAME SELECTOR [TAU]: the gate of runs/NAME (at keep threshold 0.TAU if
# given) with SELECTOR (h2o, snapkv) choosing the entries inside its per-head counts
# (gate_hybrid's `select`), over the windows of that context's seed table, into
# experiments/results/ppl_ctxCONTEXT/gate_NAME[_tauTAU]_selSELECTOR
gate_select() {
  local ctx=$1 name=$2 sel=$3 tau=${4:-} win=() opts=() sfx=
  ctx_windows "$ctx"
  [ -n "$tau" ] && { opts=(--policy-opt "gate_sel$sel.tau=0.$tau"); sfx=_tau$tau; }
  kvgate eval ppl --checkpoint "runs/$name/gated" \
    --policies "gate_sel$sel=gate_hybrid" --policy-opt "gate_sel$sel.select=$sel" \
    "${opts[@]}" "${win[@]}" --out "$R/ppl_ctx$ctx/gate_${name}${sfx}_sel$sel"
}
# gate_ranked CONTEXT NAME: the gate of runs/NAME ranked (gate_hybrid's `rank`) at the kept
# ratio its thresholded run reached, the same count in every layer and head, into
# experiments/results/ppl_ctxCONTEXT/gate_NAME_ranked: the gate's choice of entries at a
# uniform allocation
gate_ranked() {
  local ctx=$1 name=$2 win=() out=$R/ppl_ctx$1
  ctx_windows "$ctx"
  kvgate eval ppl --checkpoint "runs/$name/gated" --policies ranked=gate_hybrid \
    --policy-opt ranked.rank=true --budgets "$(kept_ratios "$out/gate_$name/results.json")" \
    "${win[@]}" --out "$out/gate_${name}_ranked"
}
# the config layers of the one-shot 1,024-token gates with a 64-key band
ONESHOT64=(--config cpt_recipe --config $C/distill_protected_long.yaml
  --config $C/oneshot64_1024.yaml)
# the config layers of abl_mc_tasks, under which its variants stack theirs
MC_TASKS=(--config cpt_recipe --config $C/mc_short.yaml
  --config $C/mc_tasks.yaml)
HEUR=full,streaming,window,h2o,tova,snapkv,adakv,nacl,ahakv

case "${1:-all}" in
  base)   # every heuristic at 50 % on the base model (7 tasks, masked mode)
    kvgate eval mc --model smollm2-135m --tasks $TASKS7 --limit 30 \
      --policies $HEUR --budgets 0.5 --mode masked --no-progress --out $R/mc_base_050
    kvgate eval mc --model smollm2-135m --tasks $TASKS7 --limit 30 \
      --policies pyramidkv,random,snapkv10=snapkv --policy-opt snapkv10.window=0.1 \
      --budgets 0.5 --mode masked --no-progress --out $R/mc_base_050
    kvgate eval mc --model smollm2-135m --tasks $TASKS7 --limit 30 --policies roco \
      --budgets 0.5 --mode cache --no-progress --out $R/mc_base_050 ;;
  cpt)    # CPT: paper recipe (gates + LoRA) and the small-compute recipe (gates only)
    kvgate train --config cpt_demo
    # the `cpt_recipe` rows were trained with the warm start on (the default before the
    # ablation), since retired: experiments/README.md names the commit that trains them
    echo "cpt_recipe as in the log: the retired warm start, see experiments/README.md" >&2 ;;
  sft)    # SFT: gates + LoRA vs LoRA only on RTE and COPA (COPA: a layer on the RTE demo)
    kvgate train --config sft_demo_rte
    kvgate train --config sft_demo_rte --model.train lora --run_dir runs/sft_demo_rte_lora
    kvgate train --config sft_demo_rte --config sft/demo_copa --run_dir runs/sft_demo_copa
    kvgate train --config sft_demo_rte --config sft/demo_copa --model.train lora \
      --run_dir runs/sft_demo_copa_lora ;;
  gate)   # a CPT gate on the 7 tasks, then the heuristics at its per-example eviction
    ck=$2; out=$3
    kvgate eval mc --checkpoint "$ck" --tasks $TASKS7 --limit 30 \
      --policies full,attention_gate --mode masked --no-progress --patterns 3 --out "$out"
    kvgate eval matched --checkpoint "$ck" --tasks $TASKS7 --limit 30 \
      --policies streaming,h2o,tova,snapkv --mode masked --no-progress --out "$out" ;;
  sfteval) # SFT checkpoints on the held-out part: gate + matched heuristics; LoRA-only at 50 %
    for t in rte copa; do
      kvgate eval mc --checkpoint runs/sft_demo_$t/gated --tasks $t --split sft_test \
        --policies full,attention_gate --mode masked --no-progress --out $R/sft_$t
      kvgate eval matched --checkpoint runs/sft_demo_$t/gated --tasks $t \
        --split sft_test --policies streaming,h2o,snapkv,tova --mode masked --no-progress \
        --out $R/sft_$t
      kvgate eval mc --checkpoint runs/sft_demo_${t}_lora/gated --tasks $t \
        --split sft_test --policies full,streaming,h2o,snapkv,tova --budgets 0.5 \
        --mode masked --no-progress --out $R/sft_${t}_lora
    done ;;
  ppl)    # held-out perplexity under eviction: gate(s) and heuristics at given kept ratios
    ck=$2; out=$3; budgets=$4
    kvgate eval ppl --checkpoint "$ck" --policies full,attention_gate --docs 40 \
      --max-length 512 --no-progress --out "$out"
    kvgate eval ppl --checkpoint "$ck" --policies streaming,h2o,tova,snapkv \
      --budgets "$budgets" --docs 40 --max-length 512 --no-progress --out "$out" ;;
  ablation) # issue #7 ablation: cpt_recipe with switches taken away (experiments/configs/)
    for v in lm_alpha20 distill distill_protected distill_protected_long; do
      variant abl_$v --config cpt_recipe --config $C/$v.yaml
    done
    # the 1,024-token variant with a 128-token recent band, then with a prompt/continuation split
    for v in recent128_long prompt_split_long; do
      variant abl_$v --config cpt_recipe --config $C/distill_protected_long.yaml --config $C/$v.yaml
    done
    # 100 more steps on the recent-band gate, from its export (model.init_from)
    variant abl_recent128_more --config cpt_recipe --config $C/distill_protected_long.yaml \
      --config $C/recent128_long.yaml --config $C/recent128_more.yaml
    # a 64-key band on 256-token blocks
    variant abl_recent64_256 --config cpt_recipe --config $C/recent64_256.yaml ;;
  pplctx) # perplexity at a fixed context: every gate, then the heuristics at each gate's eviction
    ctx=$2; cont=$3; windows=$4; out=$5; shift 5
    gates=("$@")   # gated checkpoint folders, e.g. runs/cpt_recipe/gated runs/abl_distill/gated
    # held-out tail: the last 2,000 documents for 256-token windows, 4,000 from 1,024 on (32
    # windows of 2,048 tokens need more text); the rows in experiments/LOG.md used exactly these
    docs=$(( ctx >= 1024 ? 4000 : 2000 ))
    win=(--docs "$docs" --context "$ctx" --continuation "$cont" --windows "$windows" --no-progress)
    for ck in "${gates[@]}"; do
      name=$(basename "$(dirname "$ck")")
      kvgate eval ppl --checkpoint "$ck" --policies attention_gate "${win[@]}" \
        --out "$out/gate_$name"
    done
    budgets=$(kept_ratios "$out"/gate_*/results.json)
    kvgate eval ppl --model smollm2-135m --policies full "${win[@]}" --out "$out/heuristics"
    kvgate eval ppl --model smollm2-135m --policies h2o,snapkv,streaming,random \
      --budgets "$budgets" "${win[@]}" --out "$out/heuristics" ;;
  needle) # passkey retrieval by length and depth (rank scoring, the question inside the
    # compressed prompt as when these were measured: --query-aware): base model 1k-8k, a gate
    kvgate eval needle --model smollm2-135m --lengths 1024,2048 --depths 0,50,100 \
      --samples 2 --policies full,streaming,h2o,snapkv,tova --budgets 0.25 --scoring rank --query-aware \
      --no-progress --out $R/needle
    kvgate eval needle --model smollm2-135m --lengths 4096,8192 --depths 0,50,100 \
      --samples 1 --policies full,h2o,streaming,snapkv --budgets 0.25 --scoring rank --query-aware \
      --no-progress --out $R/needle_long
    # the 1,024-token-trained gate next to H2O / StreamingLLM (train it with the ablation step)
    g=runs/abl_distill_protected_long/gated
    kvgate eval needle --checkpoint $g --lengths 1024,2048 --depths 0,50,100 --samples 2 \
      --policies attention_gate,h2o,streaming --budgets 0.4 --scoring rank --query-aware --no-progress \
      --out $R/needle_gate
    kvgate eval needle --checkpoint $g --lengths 4096 --depths 0,50,100 --samples 1 \
      --policies attention_gate,h2o,streaming --budgets 0.4 --scoring rank --query-aware --no-progress \
      --out $R/needle_gate ;;
  mcshort) # a one-shot gate sized for the short MC contexts, then the 7 tasks at ~42% eviction
    variant abl_mc_short --config cpt_recipe --config $C/mc_short.yaml
    ck=runs/abl_mc_short/gated; out=$R/mc_short_050
    mc=(--checkpoint $ck --tasks $TASKS7 --no-progress)
    kvgate eval mc "${mc[@]}" --limit 100 --policies attention_gate,full --mode masked --out $out
    kvgate eval matched "${mc[@]}" --limit 100 --policies streaming,h2o,tova,snapkv \
      --mode masked --out $out
    kvgate eval matched "${mc[@]}" --limit 100 --policies roco --mode cache --out $out
    # the gate and the three strongest heuristics on 100 more examples per task (COPA has 100)
    kvgate eval matched "${mc[@]}" --limit 200 --policies h2o,tova --mode masked --out $out
    kvgate eval matched "${mc[@]}" --limit 200 --policies roco --mode cache --out $out
    # the full cache on all 1,300: a gates-only checkpoint with its gates open is the base
    kvgate eval mc --model smollm2-135m --tasks $TASKS7 --limit 200 --policies full \
      --mode masked --no-progress --out $R/mc_short_full
    python experiments/summarize_mc.py $out $R/mc_short_full --paired attention_gate
    python experiments/summarize_mc.py $out $R/mc_short_full --paired full --any-mode ;;
  mctasks) # abl_mc_short's gate trained on MC prompts of four other tasks (needs `cpt` first)
    variant abl_mc_tasks "${MC_TASKS[@]}"
    gate_vs_best_heuristics runs/abl_mc_tasks/gated $R/mc_tasks
    python experiments/summarize_mc.py $R/mc_tasks $R/mc_tasks_b $R/mc_short_full \
      --paired full --any-mode ;;
  mctasksall) # abl_mc_tasks' gate trained on with every answer choice distilled (needs `mctasks`)
    all=("${MC_TASKS[@]}" --config $C/mc_tasks_all.yaml)
    variant abl_mc_tasks_all "${all[@]}"
    gate_vs_best_heuristics runs/abl_mc_tasks_all/gated $R/mc_tasks_all
    # against the heuristics at the fixed 50% budget (`headroom`) and the full cache
    python experiments/summarize_mc.py $R/mc_tasks_all $R/mc_headroom_a \
      $R/mc_headroom_b $R/mc_short_full --paired attention_gate --any-mode
    # its control: the same 80 more steps on the gold answer alone
    variant abl_mc_tasks_more "${all[@]}" --config $C/mc_tasks_more.yaml
    kvgate eval matched --checkpoint runs/abl_mc_tasks_more/gated --tasks $TASKS7 \
      --limit 200 --no-progress --policies h2o --mode masked --out $R/mc_tasks_more
    python experiments/summarize_mc.py $R/mc_tasks_more $R/mc_headroom_a \
      $R/mc_short_full --paired attention_gate --any-mode ;;
  mctaskslora) # abl_mc_tasks' gate trained on with LoRA distilled towards the frozen base
    lora=("${MC_TASKS[@]}" --config $C/mc_tasks_all.yaml --config $C/mc_tasks_more.yaml
      --config $C/mc_tasks_lora.yaml)
    variant abl_mc_tasks_lora "${lora[@]}"
    lora_gate_vs_heuristics runs/abl_mc_tasks_lora/gated $R/mc_tasks_lora h2o,tova
    # the adapter's lr raised 4x
    variant abl_mc_tasks_lora_hi "${lora[@]}" --config $C/mc_tasks_lora_hi.yaml
    lora_gate_vs_heuristics runs/abl_mc_tasks_lora_hi/gated $R/mc_tasks_lora_hi h2o ;;
  mctasksseed1) # abl_mc_tasks again with another seed (training and prompt order)
    variant abl_mc_tasks_seed1 "${MC_TASKS[@]}" --config $C/mc_tasks_seed1.yaml
    matched_split runs/abl_mc_tasks_seed1/gated $R/mc_tasks_seed1 h2o ;;
  mctasksbidir) # abl_mc_tasks with a gate that reads the whole prompt (needs `cpt`)
    variant abl_mc_tasks_bidir "${MC_TASKS[@]}" --config $C/mc_tasks_bidir.yaml
    matched_split runs/abl_mc_tasks_bidir/gated $R/mc_tasks_bidir h2o,tova ;;
  mctasksb22) # abl_mc_tasks aimed at ~68% eviction, where the heuristics lose more (needs `cpt`)
    variant abl_mc_tasks_b22 "${MC_TASKS[@]}" --config $C/mc_tasks_b22.yaml
    matched_split runs/abl_mc_tasks_b22/gated $R/mc_tasks_b22 h2o,tova ;;
  mctasks3shot) # abl_mc_tasks trained on 3-shot prompts (MMLU out), then scored as `mcfewshot`
    # scores the zero-shot gates: 3-shot, 200 per task (needs `cpt`)
    variant abl_mc_tasks_3shot "${MC_TASKS[@]}" --config $C/mc_tasks_3shot.yaml
    bash "$0" mcfewshot abl_mc_tasks_3shot 3 200 ;;
  mcselect) # NAME OUT HEUR...: the MC gate of runs/NAME as trained and as gate_hybrid with
    # select=h2o (its counts per example, layer and KV head; H2O's choice inside them), at H2O's
    # default recent
    # half and with H2O's recent window set to the gate's own 3-token band (_r3), on the 7
    # tasks; H2O_r3 at the gate's eviction; paired with the HEUR folders (H2O at the gate's
    # budgets, e.g. experiments/results/mc_tasks), H2O at 0.5 and the full cache
    ck=runs/$2/gated; out=$3; shift 3
    mc=(--checkpoint "$ck" --tasks $TASKS7 --limit 200 --no-progress --mode masked --out "$out")
    kvgate eval mc "${mc[@]}" \
      --policies attention_gate,gate_h2o=gate_hybrid,gate_h2o_r3=gate_hybrid \
      --policy-opt gate_h2o.select=h2o --policy-opt gate_h2o_r3.select=h2o \
      --policy-opt 'gate_h2o_r3.select_options={"recent": 3}'
    kvgate eval matched "${mc[@]}" --policies h2o_r3=h2o --policy-opt h2o_r3.recent=3 \
      --rounding nearest
    python experiments/summarize_mc.py "$out" "$@" $R/mc_headroom_a $R/mc_short_full \
      --paired gate_h2o_r3 --any-mode --merge ;;
  mcfewshot) # NAME K LIMIT [TASKS]: the MC gate of runs/NAME on K-shot prompts
    # (kvgate.data.fewshot), the first LIMIT examples of each task; then H2O with the gate's
    # 3-token window, default H2O, SnapKV and the full cache at its per-example eviction, task
    # by task, into experiments/results/mc_<NAME without abl_>_Kshot_nLIMIT (two of these side
    # by side may split the tasks between them: they share the folder)
    name=$2; k=$3; limit=$4; tasks=${5:-$TASKS7}
    out=$R/mc_${name#abl_mc_}_${k}shot_n$limit
    kvgate eval matched --checkpoint "runs/$name/gated" --tasks "$tasks" \
      --limit "$limit" --num-fewshot "$k" --no-progress --mode masked --patterns 0 \
      --policies h2o_r3=h2o,h2o,snapkv,full --policy-opt h2o_r3.recent=3 --out "$out"
    python experiments/summarize_mc.py "$out" --paired attention_gate ;;
  mctasksranked) # abl_mc_tasks' gate ranking at the heuristics' fixed budgets (needs `mctasks`)
    for b in 0.5 0.3; do
      kvgate eval mc --checkpoint runs/abl_mc_tasks/gated --tasks $TASKS7 --limit 200 \
        --no-progress --mode masked --policies ranked=gate_hybrid --policy-opt ranked.rank=true \
        --budgets $b --out $R/mc_tasks_ranked_${b/./}0
    done
    python experiments/summarize_mc.py $R/mc_tasks_ranked_050 $R/mc_tasks_ranked_030 \
      $R/mc_headroom_a $R/mc_headroom_b $R/mc_headroom_c --paired ranked \
      --same-budget --any-mode ;;
  pplseed) # the 1,024-token chain behind abl_oneshot128_more again with another seed (SEED),
    # then its gate and H2O / SnapKV at its eviction over the 64 windows of the seed-0 gate; a
    # stage whose export exists is skipped, one with a last.ckpt resumes from it. Only the
    # seed and the output folders change (--run_dir): documents and order stay seed 0's, as
    # another corpus sample could overlap the held-out tail the perplexity runs read.
    seed=$2
    chain=(--config cpt_recipe --config $C/distill_protected_long.yaml)
    start=()
    for s in recent128_long recent128_more oneshot128_1024 oneshot128_more; do
      chain+=(--config $C/$s.yaml)
      run=runs/abl_${s}_seed$seed
      seed_run "$run" "$seed" "${chain[@]}" "${start[@]}"
      start=(--model.init_from "$run/gated")   # the next stage starts from this one
    done
    ctx1024_score "abl_oneshot128_more_seed$seed" h2o,snapkv ;;
  ctx256seed) # abl_recent64_256 (the 256-token win) again with another seed (SEED), then its
    # gate at tau 0.5 and 0.56 and the heuristics at its evictions over the same 128 windows
    seed=$2; run=runs/abl_recent64_256_seed$seed; out=$R/ppl_ctx256
    seed_run "$run" "$seed" --config cpt_recipe --config $C/recent64_256.yaml
    win=("${WIN256[@]}")
    kvgate eval ppl --checkpoint "$run/gated" --policies attention_gate "${win[@]}" \
      --out "$out/gate_abl_recent64_256_seed$seed"
    kvgate eval ppl --checkpoint "$run/gated" --policies gate_tau56=attention_gate \
      --policy-opt gate_tau56.tau=0.56 "${win[@]}" \
      --out "$out/gate_abl_recent64_256_seed${seed}_tau56"
    budgets=$(kept_ratios "$out/gate_abl_recent64_256_seed$seed/results.json" \
      "$out/gate_abl_recent64_256_seed${seed}_tau56/results.json")
    kvgate eval ppl --model smollm2-135m --policies h2o,snapkv,streaming,random \
      --budgets "$budgets" "${win[@]}" --out "$out/heuristics"
    python experiments/summarize_ablation.py "$out" ;;
  curve256) # the 256-token gates of seeds 1-4 (abl_recent64_256_seed<k>, the ctx256seed
    # step) at keep thresholds 0.6 and 0.65 (trained at 0.5; 0.56 is the ctx256seed step), so
    # each gate is a curve over ~40-58% eviction, with H2O at every eviction they reach and
    # SnapKV and StreamingLLM at 55-65% for their curves. Two queues side by side: PART a
    # (seeds 1-2) and b (seeds 3-4, then SnapKV and StreamingLLM). Seed 0's gate
    # (runs/abl_recent64_256) was not on the machine that ran this; add "" to a's seeds for it
    part=${2:-}; out=$R/ppl_ctx256
    [[ "$part" =~ ^[ab]$ ]] || { echo "curve256: PART must be a or b" >&2; exit 2; }
    win=("${WIN256[@]}")
    seeds=(_seed1 _seed2); [ "$part" = b ] && seeds=(_seed3 _seed4)
    gates=()
    for s in "${seeds[@]}"; do gate_taus "abl_recent64_256$s" 60 65; done
    kvgate eval ppl --model smollm2-135m --policies h2o \
      --budgets "$(kept_ratios "${gates[@]}")" "${win[@]}" --out "$out/heuristics"
    [ "$part" = b ] && kvgate eval ppl --model smollm2-135m \
      --policies snapkv,streaming --budgets 0.45,0.4,0.35 "${win[@]}" --out "$out/heuristics"
    python experiments/summarize_ablation.py "$out" ;;
  ctx256b25) # a 256-token gate trained for more eviction (beta 0.25, recent64_256_b25) as seed
    # SEED (0: runs/abl_recent64_256_b25, k: ..._seed<k>), scored at keep thresholds 0.5 (as
    # trained) and 0.56 over the 128 windows of ctx256seed, with H2O at every eviction it reaches
    # and SnapKV, StreamingLLM and random masks at the as-trained ones
    ctx256_beta_gate b25 "$2" ;;
  ctx256b15) # the same at beta 0.15 (recent64_256_b15: ~64% of the prompt), for the range past
    # the ~60% where the beta-0.25 gates stop leading H2O
    ctx256_beta_gate b15 "$2" ;;
  ctx256b05) # the same at beta 0.05 (recent64_256_b05: ~70% of the prompt), for the range
    # past the ~66% where the beta-0.15 gates stop leading H2O
    ctx256_beta_gate b05 "$2" ;;
  ctx256band32) # the same with a 32-token band at beta 0.2 (recent64_256_band32_b20: ~69% of
    # the prompt), to see whether the band, not the training, ends the lead at ~66%
    ctx256_beta_gate band32_b20 "$2" ;;
  curve256b25) # the beta-0.25 gates of the ctx256b25 step (SEED...: 0 is the unsuffixed run)
    # at keep thresholds 0.44 and 0.65 besides 0.5 and 0.56, so each is a curve over ~50-64%
    # eviction, with H2O at every eviction they reach (SnapKV, StreamingLLM: the curve256 step)
    shift; beta_curve b25 "44 65" "$@" ;;
  curve256b15) # the beta-0.15 gates of the ctx256b15 step at keep thresholds 0.65 and 0.75
    # (~68% and ~71% on the first 6 windows), to find where their lead over H2O ends
    shift; beta_curve b15 "65 75" "$@" ;;
  curve256band32) # the band-32 gates of the ctx256band32 step at keep threshold 0.65 (past the
    # ~74% of tau 0.56), to find where their lead over H2O ends
    shift; beta_curve band32_b20 "65" "$@" ;;
  curve256band32low) # the same gates at keep thresholds 0.35 and 0.44: do they lead H2O below
    # the ~69% they were trained for too, where the 64-token band's gates do?
    shift; beta_curve band32_b20 "35 44" "$@" ;;
  curve256band32mid) # the same gates at keep thresholds 0.2 and 0.27 (~46% and ~52% on the
    # first 6 windows): does the gate trained for ~69% also lead H2O at ~50%?
    shift; beta_curve band32_b20 "20 27" "$@" ;;
  ctx1024band64) # the band-32 256-token gate of seed SEED trained on one-shot at 1,024 tokens
    # with a 64-key band (oneshot64_1024.yaml), then its gate and H2O / SnapKV at its eviction
    seed=$2; sfx=; [ "$seed" = 0 ] || sfx=_seed$seed
    ctx1024_gate "abl_oneshot64_1024$sfx" "$seed" h2o,snapkv "${ONESHOT64[@]}" \
      --model.init_from "runs/abl_recent64_256_band32_b20$sfx/gated" ;;
  ctx1024band64more) # the ctx1024band64 gate of seed SEED trained 160 more one-shot steps on
    # new documents (oneshot64_1024_more.yaml), then its gate and H2O at its eviction
    seed=$2; sfx=; [ "$seed" = 0 ] || sfx=_seed$seed
    ctx1024_gate "abl_oneshot64_1024_more$sfx" "$seed" h2o "${ONESHOT64[@]}" \
      --config $C/oneshot64_1024_more.yaml \
      --model.init_from "runs/abl_oneshot64_1024$sfx/gated" ;;
  select) # CONTEXT SELECTOR[:TAU] NAME...: the gates of runs/NAME... (at keep threshold 0.TAU)
    # with SELECTOR choosing inside their per-head counts (gate_select), then the summary: the
    # gate's allocation of the cache over layers and heads, with the heuristic's choice
    ctx=$2 sel=${3%%:*} tau=; [[ $3 == *:* ]] && tau=${3#*:}; shift 3
    for name in "$@"; do gate_select "$ctx" "$name" "$sel" "$tau"; done
    python experiments/summarize_ablation.py "$R/ppl_ctx$ctx" ;;
  ranked) # CONTEXT NAME...: the gates of runs/NAME... ranked at their own kept ratio in every
    # layer and head (gate_ranked), then the summary: the gate's choice without its allocation
    ctx=$2; shift 2
    for name in "$@"; do gate_ranked "$ctx" "$name"; done
    python experiments/summarize_ablation.py "$R/ppl_ctx$ctx" ;;
  h2or32) # H2O with a 32-token recent window (the LongBench-style setting) at the kept ratios
    # behind the select / band-32 perplexity claims, beside default H2O (experiments/LOG.md 5c)
    r32=(--model smollm2-135m --policies h2o_r32=h2o --policy-opt h2o_r32.recent=32)
    kvgate eval ppl "${r32[@]}" --budgets 0.53,0.51,0.5,0.47,0.31,0.3 "${WIN256[@]}" \
      --out $R/ppl_ctx256/heuristics
    ctx_windows 1024
    kvgate eval ppl "${r32[@]}" --budgets 0.48,0.49 "${win[@]}" \
      --out $R/ppl_ctx1024/heuristics ;;
  headroom) # how far the best heuristics sit below the full cache on the 7 tasks (base model)
    mc=(--model smollm2-135m --tasks $TASKS7 --limit 200 --budgets 0.5,0.3 --no-progress)
    kvgate eval mc "${mc[@]}" --policies h2o --mode masked --out $R/mc_headroom_a
    kvgate eval mc "${mc[@]}" --policies tova --mode masked --out $R/mc_headroom_b
    # H2O with a 3-token recent window, the MC gates' closing band (experiments/LOG.md 5b,
    # gate_hybrid select=h2o)
    kvgate eval mc "${mc[@]}" --policies h2o_r3=h2o --policy-opt h2o_r3.recent=3 \
      --mode masked --out $R/mc_headroom_r3
    # RoCo streams its cache block by block (slow): one folder per budget, so the two can run
    # side by side
    mc=(--model smollm2-135m --tasks $TASKS7 --limit 200 --no-progress --policies roco --mode cache)
    kvgate eval mc "${mc[@]}" --budgets 0.5 --out $R/mc_headroom_b
    kvgate eval mc "${mc[@]}" --budgets 0.3 --out $R/mc_headroom_c
    python experiments/summarize_mc.py $R/mc_headroom_a $R/mc_headroom_b \
      $R/mc_headroom_c $R/mc_headroom_r3 $R/mc_short_full --paired full --any-mode ;;
  powered)  # PART: docs/RESULTS.md section 3, RULER with the question asked after compression,
    # scored by teacher forcing (greedy-exact after the model's greedy lead-in), bf16, at 50%
    # eviction, 48 examples per (family, length) (KVzip: 24 at 2k, 8 at 4k). Each PART writes
    # folders of $R/ruler/ (4k apart, so that it can run beside the rest).
    pw=(--tasks niah_single_1,niah_single_2 --score teacher --dtype bfloat16 --no-progress)
    heur=(--policies full,streaming,h2o,tova,snapkv,knorm,adakv,tova_g=tova
          --policy-opt tova_g.allocation=global --budgets 0.5 --paired full)
    case "$2" in
      # the full cache and the heuristics (TOVA also ranked globally), one shared prefill per
      # example -> $R/ruler/powered (1k, 2k) and $R/ruler/powered_4k
      heuristics)
         kvgate eval ruler --model smollm2-135m "${pw[@]}" "${heur[@]}" --lengths 1024 --limit 48 \
           --out $R/ruler/powered
         kvgate eval ruler --model smollm2-135m "${pw[@]}" "${heur[@]}" --lengths 2048 --limit 48 \
           --out $R/ruler/powered
         kvgate eval ruler --model smollm2-135m "${pw[@]}" "${heur[@]}" --lengths 4096 --limit 48 \
           --out $R/ruler/powered_4k ;;
      # a trained gate at its keep threshold (trained first if missing) -> $R/ruler/powered_GATE
      # (1k, 2k) and $R/ruler/powered_GATE_4k
      # (cpt_kvzap_quick: the main job's gate, bash scripts/main.sh, labels first)
      cpt_long|cpt_recipe|cpt_oracle|cpt_kvzap|cpt_kvzap_quick)
         [ -f runs/$2/gated/kvgate_config.json ] || { kvgate data oracle --config $2
           kvgate train --config $2 --ckpt_path last; }
         pol=attention_gate; [ "${2#cpt_kvzap}" != "$2" ] && pol=local_gate  # MLP gates' policy
         g=(--checkpoint runs/$2/gated "${pw[@]}" --policies $pol)
         # cpt_long keeps its 4k records beside its 1k / 2k ones
         four=$R/ruler/powered_${2}_4k; [ "$2" = cpt_long ] && four=$R/ruler/powered_$2
         kvgate eval ruler "${g[@]}" --lengths 2048 --limit 48 --out $R/ruler/powered_$2
         kvgate eval ruler "${g[@]}" --lengths 4096 --limit 48 --out "$four"
         kvgate eval ruler "${g[@]}" --lengths 1024 --limit 48 --out $R/ruler/powered_$2 ;;
      # KVzip and KVzip+, per head and ranked globally, at 25 / 50 / 75% eviction (2k and 1k, 24
      # a family; 4k, 16 a family, ~3 min an example: one prefill and one repeat pass per
      # example serve all twelve, SharedPasses), beside the full cache on the heuristics'
      # examples -> $R/ruler/powered_kvzip and $R/ruler/powered_kvzip_4k
      kvzip)
         kz=(--policies full,kvzip,kvzip_g=kvzip,kvzipp=kvzip,kvzipp_g=kvzip
             --budgets 0.75,0.5,0.25 --paired full
             --policy-opt kvzip_g.allocation=global --policy-opt kvzipp_g.allocation=global
             --policy-opt kvzipp_g.plus=true --policy-opt kvzipp.plus=true)
         for n in 2048 1024; do
           kvgate eval ruler --model smollm2-135m "${pw[@]}" "${kz[@]}" --lengths $n --limit 24 \
             --out $R/ruler/powered_kvzip
         done
         kvgate eval ruler --model smollm2-135m "${pw[@]}" "${kz[@]}" --lengths 4096 --limit 16 \
           --out $R/ruler/powered_kvzip_4k
         # KVzip global at 50% (the #45 target's cell) at 24 a family
         kvgate eval ruler --model smollm2-135m "${pw[@]}" --policies kvzip_g=kvzip \
           --policy-opt kvzip_g.allocation=global --budgets 0.5 --lengths 4096 --limit 24 \
           --out $R/ruler/powered_kvzip_4k ;;
      # each gate's tau for 25 / 50 / 75% eviction at 1k / 2k / 4k, found on 4 held-out
      # haystacks of the two families (seeds 1000-1001) -> $R/calibration/GATE
      # the papers' other heuristics at 50% (issue #65): NaCl, AhaKV, PyramidKV from one shared
      # prefill, RoCo alone (a streamed prefill) -> $R/ruler/powered_more[_4k], powered_roco[_4k]
      more)
         for n in 2048 4096; do
           sfx=""; [ $n = 4096 ] && sfx=_4k
           kvgate eval ruler --model smollm2-135m "${pw[@]}" --lengths $n --limit 48 \
             --policies nacl,ahakv,pyramidkv --budgets 0.5 --out $R/ruler/powered_more$sfx
           kvgate eval ruler --model smollm2-135m "${pw[@]}" --lengths $n --limit 48 \
             --policies roco --budgets 0.5 --out $R/ruler/powered_roco$sfx
         done ;;
      # 87.5% and 75% eviction (issue #65): the heuristics at 0.125, the main job's gate at the
      # thresholds calibrated per length for 75 / 87.5% (c75 / c875), 48 a family
      p875)
         g=runs/cpt_kvzap_quick/gated
         [ -f $g/kvgate_config.json ] || { kvgate data oracle --config cpt_kvzap_quick
           kvgate train --config cpt_kvzap_quick; }
         kvgate eval calibrate --checkpoint $g --policies local_gate --dtype bfloat16 \
           --tasks niah_single_1,niah_single_2 --limit 2 --lengths 4096,2048 \
           --evict 0.25,0.75,0.875 --no-progress --out $R/calibration/cpt_kvzap_quick
         tau() {  # LENGTH TARGET -> the calibrated tau
           python -c "import json; f=json.load(open('$R/calibration/cpt_kvzap_quick/calibration.json'))['fits']; \
print(round(next(x['tau'] for x in f if x['length'] == $1 and x['target'] == $2), 4))"
         }
         for n in 2048 4096; do
           sfx=""; [ $n = 4096 ] && sfx=_4k
           kvgate eval ruler --checkpoint $g "${pw[@]}" --lengths $n --limit 48 \
             --policies c75=local_gate,c875=local_gate --policy-opt c75.tau=$(tau $n 0.75) \
             --policy-opt c875.tau=$(tau $n 0.875) --out $R/ruler/powered_cpt_kvzap_quick$sfx
           kvgate eval ruler --model smollm2-135m "${pw[@]}" --lengths $n --limit 48 \
             --policies tova,knorm,streaming --budgets 0.125 --out $R/ruler/powered$sfx
         done ;;
      # KVzip ranked globally at 87.5% eviction (issue #65), 24 a family as its other cells;
      # LENGTHS="2048 4096" by default (at 4k ~3 min an example)
      kvzip875)
         for n in ${LENGTHS:-2048 4096}; do
           sfx=""; [ $n = 4096 ] && sfx=_4k
           kvgate eval ruler --model smollm2-135m "${pw[@]}" --policies kvzip_g=kvzip \
             --policy-opt kvzip_g.allocation=global --budgets 0.125 --lengths $n --limit 24 \
             --out $R/ruler/powered_kvzip$sfx
         done ;;
      # the main job's gate ranked under the budget (gate_rank; issue #65's threshold lever):
      # one cut over all layers and KV heads (rank_g), at 75 and 87.5% eviction, on the examples
      # of the rows above (within every KV head, rank_h, collapses: LOG 7q; RANK_HEAD=1 adds it)
      rank)
         g=${GATE:-runs/cpt_kvzap_quick/gated}
         [ -f $g/kvgate_config.json ] || { kvgate data oracle --config cpt_kvzap_quick
           kvgate train --config cpt_kvzap_quick; }
         for n in 2048 4096; do
           sfx=""; [ $n = 4096 ] && sfx=_4k
           kvgate eval ruler --checkpoint $g "${pw[@]}" --lengths $n --limit 48 \
             --policies rank_g=gate_rank${RANK_HEAD:+,rank_h=gate_rank} \
             --policy-opt rank_g.allocation=global \
             --budgets 0.25,0.125 --out $R/ruler/powered_rank${GATE_TAG:-}$sfx
         done ;;
      # issue #65's training levers, each a variant of the main job's recipe (experiments/configs),
      # trained on its labels and scored ranked globally as `rank` scores the main job's gate;
      # a screen by default: LEVERS="rank25 attention" LENGTHS=2048 LIMIT=24 BUDGETS=0.25
      levers)
         for lever in ${LEVERS:-rank25 attention}; do
           g=runs/lever_$lever/gated
           [ -f $g/kvgate_config.json ] || kvgate train --config cpt_kvzap_quick \
             --config $C/lever_$lever.yaml --run_dir runs/lever_$lever
           for n in ${LENGTHS:-2048}; do
             sfx=""; [ $n = 4096 ] && sfx=_4k
             kvgate eval ruler --checkpoint $g "${pw[@]}" --lengths $n --limit ${LIMIT:-24} \
               --policies rank_g=gate_rank --policy-opt rank_g.allocation=global \
               --budgets ${BUDGETS:-0.25} --out $R/ruler/powered_lever_$lever$sfx
           done
         done ;;
      # the attention-kind recipe (configs/cpt_kvzap_attention.yaml, the lever above made a
      # recipe) ranked over all layers at 25 / 50 / 75 / 87.5% eviction, LIMIT (48) a family,
      # trained first if missing -> $R/ruler/powered_cpt_kvzap_attention[_4k]
      attention)
         g=runs/cpt_kvzap_attention/gated
         [ -f $g/kvgate_config.json ] || { kvgate data oracle --config cpt_kvzap_attention
           kvgate train --config cpt_kvzap_attention; }
         for n in ${LENGTHS:-2048 4096}; do
           sfx=""; [ $n = 4096 ] && sfx=_4k
           kvgate eval ruler --checkpoint $g "${pw[@]}" --lengths $n --limit ${LIMIT:-48} \
             --policies rank_g=gate_rank --policy-opt rank_g.allocation=global \
             --budgets 0.75,0.5,0.25,0.125 --out $R/ruler/powered_cpt_kvzap_attention$sfx
         done ;;
      calibrate)
         for g in cpt_kvzap:local_gate cpt_oracle:attention_gate cpt_long:attention_gate; do
           kvgate eval calibrate --checkpoint runs/${g%%:*}/gated --policies ${g#*:} \
             --dtype bfloat16 --tasks niah_single_1,niah_single_2 --limit 2 \
             --lengths 4096,1024,2048 --evict 0.25,0.5,0.75 --no-progress \
             --out $R/calibration/${g%%:*}
         done ;;
      # the sweep, 25 and 75% eviction at 1k / 2k: the heuristics (48 a family) and the gates at
      # a dialled threshold (2k and 1k, 24 a family; tau calibrated on 4 contexts at 2k: e25 / e75)
      sweep)
         h=(--policies full,streaming,tova,snapkv,knorm,tova_g=tova --policy-opt tova_g.allocation=global
            --budgets 0.75,0.25 --paired full)
         for n in 2048 1024; do
           kvgate eval ruler --model smollm2-135m "${pw[@]}" "${h[@]}" --lengths $n --limit 48 \
             --out $R/ruler/powered
         done
         for g in cpt_kvzap:local_gate:0.24:0.82 cpt_oracle:attention_gate:0.18:0.76 \
                  cpt_long:attention_gate:0.23:0.67; do
           IFS=: read -r gate pol t25 t75 <<< "$g"
           for n in 2048 1024; do
             kvgate eval ruler --checkpoint runs/$gate/gated "${pw[@]}" --lengths $n --limit 24 \
               --policies e25=$pol,e75=$pol --policy-opt e25.tau=$t25 --policy-opt e75.tau=$t75 \
               --out $R/ruler/powered_$gate
           done
         done
         # 4k: the heuristics at 24 a family; the gates at the 2k threshold (KVzap, 12 a family:
         # e25 / e75) and at the one calibrated at 4k (`calibrate` first: c25 / c75; the KVzap
         # gate 24 a family, the others 12); at 1k the gates' calibrated 75% (c75, 24 a family)
         kvgate eval ruler --model smollm2-135m "${pw[@]}" "${h[@]}" --lengths 4096 --limit 24 \
           --out $R/ruler/powered_4k
         kvgate eval ruler --checkpoint runs/cpt_kvzap/gated "${pw[@]}" --lengths 4096 --limit 12 \
           --policies e25=local_gate,e75=local_gate --policy-opt e25.tau=0.24 \
           --policy-opt e75.tau=0.82 --out $R/ruler/powered_cpt_kvzap_4k
         tau() {  # GATE LENGTH TARGET -> its calibrated tau
           python -c "import json; f=json.load(open('$R/calibration/$1/calibration.json'))['fits']; \
print(round(next(x['tau'] for x in f if x['length'] == $2 and x['target'] == $3), 4))"
         }
         for g in cpt_kvzap:local_gate:24 cpt_oracle:attention_gate:12 \
                  cpt_long:attention_gate:12; do
           IFS=: read -r gate pol lim <<< "$g"
           kvgate eval ruler --checkpoint runs/$gate/gated "${pw[@]}" --lengths 4096 \
             --limit $lim --policies c25=$pol,c75=$pol --policy-opt c25.tau=$(tau $gate 4096 0.25) \
             --policy-opt c75.tau=$(tau $gate 4096 0.75) --out $R/ruler/powered_${gate}_4k
         done
         for g in cpt_kvzap:local_gate cpt_oracle:attention_gate cpt_long:attention_gate; do
           kvgate eval ruler --checkpoint runs/${g%%:*}/gated "${pw[@]}" --lengths 1024 \
             --limit 24 --policies c75=${g#*:} --policy-opt c75.tau=$(tau ${g%%:*} 1024 0.75) \
             --out $R/ruler/powered_${g%%:*}
         done ;;
      # decode-time eviction: 8 windows of 1,024 context tokens, the next 512 scored one token
      # per forward (--step 1) while the cache evicts; the KVzap gate (threshold + 128-token
      # window), then H2O, TOVA and StreamingLLM holding the share it kept -> $R/ppl_decode
      # (the records say what each cache holds at the end: held_end_pct; the stored folder
      # predates it, its gate and TOVA rows rerun with it in $R/ppl_decode_held)
      decode)
         d=(--checkpoint runs/cpt_kvzap/gated --mode cache --step 1 --context 1024
            --continuation 512 --windows 8 --docs 200 --batch-size 8 --dtype bfloat16
            --no-progress --out $R/ppl_decode)
         kvgate eval ppl "${d[@]}" --policies full,local_gate
         keep=$(python -c "import json; r=json.load(open('$R/ppl_decode/results.json'))['results']; \
print(round(1 - next(v for k, v in r.items() if '|local_gate|' in k)['evict_pct'] / 100, 2))")
         kvgate eval ppl "${d[@]}" --policies h2o,tova,streaming --budgets "$keep"
         python experiments/summarize_decode.py $R/ppl_decode ;;  # the gaps, t intervals
      # the gate and TOVA again, recording what each cache holds at the end (the gate keeps
      # generated tokens above its threshold: it ends holding more than its prefill share),
      # then H2O, TOVA and StreamingLLM holding what the gate holds at the end -> $R/ppl_decode_held
      decode_held)
         ctx=1024; cont=512
         d=(--checkpoint runs/cpt_kvzap/gated --mode cache --step 1 --context $ctx
            --continuation $cont --windows 8 --docs 200 --batch-size 8 --dtype bfloat16
            --no-progress --out $R/ppl_decode_held)
         kvgate eval ppl "${d[@]}" --policies local_gate
         kvgate eval ppl "${d[@]}" --policies tova --budgets 0.52
         # the gate's entries at the end over the context's: held_end_pct x (ctx + cont) / ctx
         end=$(python -c "import json; r=json.load(open('$R/ppl_decode_held/results.json'))['results']; \
print(round(next(v for k, v in r.items() if '|local_gate|' in k)['held_end_pct'] * ($ctx + $cont) / $ctx / 100, 2))")
         kvgate eval ppl "${d[@]}" --policies tova,h2o,streaming --budgets "$end"
         python experiments/summarize_decode.py $R/ppl_decode_held ;;
      # which families qualify: the full cache on the other families, 8 examples at 1k
      # (niah_single_3 also at 2k / 4k) -> $R/ruler/screen
      screen)
         kvgate eval ruler --model smollm2-135m --lengths 1024 --limit 8 --policies full \
           --tasks niah_single_3,niah_multikey_1,niah_multikey_2,niah_multivalue,niah_multiquery,vt,fwe,qa_1 \
           --score teacher --dtype bfloat16 --no-progress --out $R/ruler/screen
         kvgate eval ruler --model smollm2-135m --lengths 2048,4096 --limit 8 --policies full \
           --tasks niah_single_3 --score teacher --dtype bfloat16 --no-progress --out $R/ruler/screen ;;
      # teacher scoring against generation (32 tokens) on the same examples: the cost ratios
      # and the agreement, disagreeing answers listed -> $R/teacher/bench_{1024,4096}.json
      agree) mkdir -p $R/teacher
         for n in 1024 4096; do
           python bench/bench_teacher.py --length $n --examples $([ $n = 1024 ] && echo 8 || echo 3) \
             --threads 1 --dtype bfloat16 --json $R/teacher/bench_$n.json
         done ;;
      # the table: scores with n, paired gaps to the full cache and the best heuristic
      table) python experiments/summarize_paired.py $R/ruler/powered $R/ruler/powered_4k \
           $R/ruler/powered_more $R/ruler/powered_more_4k $R/ruler/powered_roco \
           $R/ruler/powered_roco_4k \
           cpt_recipe=$R/ruler/powered_cpt_recipe cpt_recipe=$R/ruler/powered_cpt_recipe_4k \
           cpt_long=$R/ruler/powered_cpt_long cpt_long=$R/ruler/powered_cpt_long_4k \
           cpt_oracle=$R/ruler/powered_cpt_oracle cpt_oracle=$R/ruler/powered_cpt_oracle_4k \
           cpt_kvzap=$R/ruler/powered_cpt_kvzap cpt_kvzap=$R/ruler/powered_cpt_kvzap_4k \
           cpt_kvzap_quick=$R/ruler/powered_cpt_kvzap_quick \
           cpt_kvzap_quick=$R/ruler/powered_cpt_kvzap_quick_4k \
           kvzip=$R/ruler/powered_kvzip kvzip=$R/ruler/powered_kvzip_4k
         # the sweep at 4k and 2k, 25 / 50 / 75 / 87.5% eviction: the gates at their calibrated
         # thresholds (c25 / c75 / c875; at 2k cpt_kvzap's dialled by hand: e25 / e75) and the
         # main job's gate ranked over all layers (quick:rank_g; powered rank)
         for n in 4096 2048; do
           sfx=""; c=c; [ $n = 4096 ] && sfx=_4k; [ $n = 2048 ] && c=e
           python experiments/summarize_sweep.py $R/ruler/powered$sfx kvzip=$R/ruler/powered_kvzip$sfx \
             cpt_kvzap=$R/ruler/powered_cpt_kvzap$sfx cpt_oracle=$R/ruler/powered_cpt_oracle$sfx \
             cpt_long=$R/ruler/powered_cpt_long$sfx quick=$R/ruler/powered_cpt_kvzap_quick$sfx \
             quick=$R/ruler/powered_rank$sfx attn=$R/ruler/powered_cpt_kvzap_attention$sfx \
             --length $n --budgets 0.75,0.5,0.25,0.125 \
             --ref kvzip:kvzip_g --place quick:c75=0.25 --place quick:c875=0.125 \
             --place quick:local_gate=0.5 --place cpt_kvzap:${c}25=0.75 \
             --place cpt_kvzap:local_gate=0.5 --place cpt_kvzap:${c}75=0.25 \
             $(for g in cpt_oracle:attention_gate cpt_long:attention_gate; do
                 echo --place ${g%%:*}:${c}25=0.75 --place $g=0.5 --place ${g%%:*}:${c}75=0.25; done)
         done
         # the attention-kind recipe (powered attention) paired with the main job's gate ranked
         # and with the full cache
         for n in 2048 4096; do
           sfx=""; [ $n = 4096 ] && sfx=_4k
           for ref in quick:rank_g full; do
             python experiments/summarize_sweep.py $R/ruler/powered$sfx \
               quick=$R/ruler/powered_rank$sfx attn=$R/ruler/powered_cpt_kvzap_attention$sfx \
               --length $n --budgets 0.5,0.25,0.125 --ref $ref
           done
         done
         # the training levers' screen (powered levers), paired with quick:rank_g
         for lever in rank25 attention; do
           [ -d $R/ruler/powered_lever_$lever ] && python experiments/summarize_sweep.py \
             $R/ruler/powered quick=$R/ruler/powered_rank $lever=$R/ruler/powered_lever_$lever \
             --length 2048 --budgets 0.25 --ref quick:rank_g
         done ;;
      *) echo "powered: PART must be heuristics, kvzip, sweep, more, p875, cpt_long, cpt_recipe, cpt_oracle, cpt_kvzap, decode, decode_held, screen, agree or table" >&2
         exit 2 ;;
    esac ;;
  ruler)  # PART: issue #34's long-context table (docs/RESULTS.md section 3), the question
    # asked after compression; four RULER families where SmolLM2's full cache scores >= 30% at
    # 1k (a 13-family pilot: `--tasks all --lengths 1024 --policies full`), 3 examples per
    # (family, length), answers capped at 32 tokens. Parts a (heuristics) and b (gates, trained
    # first if missing) run side by side, one thread each; `bench` times them.
    rl=(--tasks niah_single_1,niah_single_2,niah_multikey_1,qa_1 --lengths 1024,2048,4096
        --limit 3 --max-new-tokens 32 --no-progress)
    case "$2" in
      # every one-shot heuristic at 25 / 50 / 75 % eviction from one prefill per example
      # (SharedPrefill, answers batched), SnapKV query-aware, then RoCo (a streamed prefill,
      # scored alone; at 4k about 6x the full cache's time, so 1k and 2k at 50 % only)
      a) kvgate eval ruler --model smollm2-135m "${rl[@]}" --budgets 0.5,0.25,0.75 \
           --policies full,snapkv,h2o,tova,streaming,knorm,random,pyramidkv,adakv,nacl,ahakv,window \
           --out $R/ruler/heuristics
         kvgate eval ruler --model smollm2-135m "${rl[@]}" --budgets 0.5 --query-aware \
           --policies snapkv --out $R/ruler/heuristics
         kvgate eval ruler --model smollm2-135m "${rl[@]}" --lengths 1024,2048 --budgets 0.5 \
           --policies roco --out $R/ruler/heuristics ;;
      # both gates as trained (keep threshold 0.5) and ranked at 50 % (gate_rank), then at
      # thresholds that evict ~25-30 % and ~70-77 % (found on one niah_single_2 context at 1k
      # and 4k; the table reports the eviction each reached)
      b) for g in cpt_long cpt_recipe; do
           [ -f runs/$g/gated/kvgate_config.json ] || kvgate train --config $g
         done
         declare -A taus=([cpt_long]="27 68" [cpt_recipe]="27 60")
         for g in cpt_long cpt_recipe; do
           kvgate eval ruler --checkpoint runs/$g/gated "${rl[@]}" --budgets 0.5 \
             --policies attention_gate,gate_rank=gate_hybrid --policy-opt gate_rank.rank=true \
             --out $R/ruler/$g
           pols=() opts=()
           for t in ${taus[$g]}; do
             pols+=("gate_tau$t=attention_gate"); opts+=(--policy-opt "gate_tau$t.tau=0.$t")
           done
           kvgate eval ruler --checkpoint runs/$g/gated "${rl[@]}" \
             --policies "$(IFS=,; echo "${pols[*]}")" "${opts[@]}" --out $R/ruler/$g
         done ;;
      # the gates ranked at 25 / 75 % (gate_rank), then RoCo's other cells (4k at 25 / 75 % ran
      # with the in-place eviction of LOG 7g: the same entries, another float summation order)
      c) for g in cpt_long cpt_recipe; do
           kvgate eval ruler --checkpoint runs/$g/gated "${rl[@]}" --budgets 0.25,0.75 \
             --policies gate_rank=gate_hybrid --policy-opt gate_rank.rank=true --out $R/ruler/$g
         done
         kvgate eval ruler --model smollm2-135m "${rl[@]}" --lengths 1024,2048 \
           --budgets 0.25,0.75 --policies roco --out $R/ruler/heuristics
         kvgate eval ruler --model smollm2-135m "${rl[@]}" --lengths 4096 \
           --budgets 0.5,0.25,0.75 --policies roco --out $R/ruler/heuristics ;;
      # one of the two extra training runs the issue allows: cpt_long with a gate that reads no
      # rotary positions (a length-robust gate input), at its trained threshold
      d) [ -f runs/abl_long_norope/gated/kvgate_config.json ] || variant abl_long_norope \
           --config cpt_recipe --config cpt_long --config $C/long_norope.yaml
         kvgate eval ruler --checkpoint runs/abl_long_norope/gated "${rl[@]}" --budgets 0.5 \
           --policies attention_gate --out $R/ruler/abl_long_norope ;;
      # compress + answer over the full cache's time, every policy, the trained cpt_long gate
      bench) python bench/bench_long_context.py --lengths 1024,2048,4096 --repeats 2 --threads 1 \
           --policies full,snapkv,h2o,tova,streaming,knorm,attention_gate \
           --checkpoint runs/cpt_long/gated --profile --json $R/bench_long_context/blocked.json
         python bench/bench_long_context.py --lengths 1024,2048,4096 --repeats 2 --threads 1 \
           --policies full,h2o,pyramidkv,adakv,nacl,ahakv,window,random,roco,attention_gate \
           --checkpoint runs/cpt_long/gated --json $R/bench_long_context/all_policies.json
         # the KVzap gate (scores while decoding too) at 4k, the issue #45 cost target
         python bench/bench_long_context.py --lengths 4096 --repeats 3 --threads 1 \
           --policies full,tova,local_gate --checkpoint runs/cpt_kvzap/gated \
           --json $R/bench_long_context/kvzap_4k.json
         # KVzip's prefill + repeat pass against the full cache, every length
         python bench/bench_long_context.py --lengths 1024,2048,4096 --repeats 2 --threads 1 \
           --policies full,tova,kvzip --json $R/bench_long_context/kvzip.json ;;
      *) echo "ruler: PART must be a, b, c, d or bench" >&2; exit 2 ;;
    esac
    extra=(); [ -f $R/ruler/abl_long_norope/results.json ] && extra=(long_norope=$R/ruler/abl_long_norope)
    python experiments/summarize_ruler.py $R/ruler/heuristics cpt_long=$R/ruler/cpt_long \
      cpt_recipe=$R/ruler/cpt_recipe "${extra[@]}" \
      --tasks niah_single_1,niah_single_2,niah_multikey_1,qa_1 ;;
  kvbits) # issue #67: kept K/V stored in 8 / 4 bits (--kv-bits), RULER's two NIAH families at
    # 2k and 4k as RESULTS 3 (48 a family, bf16, teacher-scored): the full cache and TOVA at 0.5,
    # the cpt_kvzap gate at its threshold; 16 bits are RESULTS 3's own records; then the tables
    pw=(--tasks niah_single_1,niah_single_2 --score teacher --dtype bfloat16 --no-progress
        --limit 48)
    for n in 2048 4096; do
      sfx=""; [ $n = 4096 ] && sfx=_4k
      for b in 8 4; do
        kvgate eval ruler --model smollm2-135m "${pw[@]}" --lengths $n --policies full,tova \
          --budgets 0.5 --kv-bits $b --out $R/ruler/kvbits$b$sfx
        kvgate eval ruler --checkpoint runs/cpt_kvzap/gated "${pw[@]}" --lengths $n \
          --policies local_gate --kv-bits $b --out $R/ruler/kvbits${b}_cpt_kvzap$sfx
      done
      python experiments/summarize_kvbits.py --length $n
    done ;;
  *) echo "usage: $0 base|cpt|sft|gate CKPT OUT|sfteval|ppl CKPT OUT BUDGETS|ablation|pplctx CTX CONT WINDOWS OUT GATE...|needle|mcshort|mctasks|mctasksall|mctaskslora|mctasksseed1|mctasksbidir|mctasksb22|mctasks3shot|mctasksranked|mcselect NAME OUT HEUR...|mcfewshot NAME K LIMIT [TASKS]|pplseed SEED|ctx256seed SEED|curve256 PART|ctx256b25 SEED|ctx256b15 SEED|ctx256b05 SEED|ctx256band32 SEED|curve256b25 SEED...|curve256b15 SEED...|curve256band32 SEED...|curve256band32low SEED...|curve256band32mid SEED...|ctx1024band64 SEED|ctx1024band64more SEED|select CONTEXT SELECTOR[:TAU] NAME...|ranked CONTEXT NAME...|h2or32|headroom|ruler PART|powered PART|kvbits" >&2; exit 2 ;;
esac
