#!/usr/bin/env bash
# GPU checks: the CUDA tests, training speed (kvgate vs materialised gated attention), Lightning
# in bf16-mixed, the paper's DeepSpeed config on one GPU, and gated generation on CUDA.
#
#   bash bench/gpu_checks.sh prepare        # here: writes .gpu/ (config, tokenizer, documents)
#   bash bench/gpu_checks.sh run OUTDIR [PART...]  # on the CUDA machine, in the repo root
#
# PARTs (all by default): tests (pytest -m gpu), bench (eq. 5 training speed, kvgate vs
# materialised), oneshot (the two-pass one-shot step vs whole-block kvgate vs materialised),
# train (train.py, DeepSpeed, infer.py on CUDA), lora (fp32 base, gates + LoRA vs LoRA only),
# gentests (the CUDA tests of generation over the compressed cache), decode (batched decode over the compressed cache vs transformers' dense cache, 4k prompts,
# batch 1 / 8 / 32, SnapKV, Ada-KV and a ranked gate at 50%, on both shapes, eager and each
# replaying one CUDA graph per step, the dense one on transformers' StaticCache), triton (the
# Triton kernel's CUDA tests, the kernel alone against the materialised one and SDPA flash,
# gates + LoRA against LoRA-only at 2k-8k in bf16-mixed and at 4k without autocast, a profiled
# step of each, gates-only against the chunked and materialised kernels, the autotuned kernel
# last), kvquant (not by default: kept entries in 8 / 4 bits against the 16-bit compressed cache,
# SnapKV at 50% of a 4k context on SmolLM2's shape in bf16: decode tokens/s, compress + answer,
# the share of decode spent dequantizing, since no fused dequantize-attention kernel is
# written; bench/bench_kv_quant.py). Each
# step of the gentests, decode, triton and kvquant parts runs under a time limit, so one slow step
# cannot eat a lease; with DEADLINE=S set, a step that would start after S seconds is skipped.
# (The FlexAttention kernel these checks also timed is removed: 3.7-14x slower than the
# chunked one on an H200, experiments/LOG.md 8c.)
#
# A 15-minute lease (H200, 2026-11-26): the random bases took ~30 s, decode ~2.5 min before the
# graphed regimes doubled it (~6 min now: run `decode` alone first).
# H100 (2026-11-27): `DEADLINE=150 run OUT triton` ran its tests, kernel timings and the gates +
# LoRA lengths in 168 s; the whole part (profile, materialised, autotuned) needs ~450 s.
# H200 (2026-11-27, session 29): the whole triton part with DEADLINE=420 took 217 s.
# The CUDA machine needs torch, transformers, peft, lightning (no network): the SmolLM2 weights
# do not travel (98 MB), so the base is a random model of SmolLM2's shape (bench/random_base.py);
# speed does not depend on weight values. Wheels in .whl/ (deepspeed, bitsandbytes, their
# dependencies) are installed first when present.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "${1:-}" = prepare ]; then
  set -e
  src="$HOME/.cache/kvgate/models/smollm2-135m"
  mkdir -p .gpu/smollm2-config
  cp "$src"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .gpu/smollm2-config/
  # Llama-2-7B's layer shape (4 of its 32 layers; SmolLM2's tokenizer, so its vocabulary):
  # at this width the attention, not kernel launches, sets the step time
  mkdir -p .gpu/llama7b-4layers
  cp .gpu/smollm2-config/tokenizer* .gpu/llama7b-4layers/
  python - <<'PY'
from transformers import LlamaConfig
LlamaConfig(vocab_size=49152, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192,
            rms_norm_eps=1e-5, tie_word_embeddings=False).save_pretrained(".gpu/llama7b-4layers")
PY
  python - <<'PY'
import json
from kvgate.data import load_corpus
with open(".gpu/docs.jsonl", "w") as f:
    for doc in load_corpus(max_docs=300):
        f.write(json.dumps({"text": doc}) + "\n")
PY
  du -sh .gpu
  exit 0
fi

usage="usage: $0 prepare | run OUTDIR [tests|bench|oneshot|train|lora|gentests|decode|triton|kvquant ...]"
[ "${1:-}" = run ] || { echo "$usage" >&2; exit 2; }
out=${2:?$usage}
shift 2
parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(tests bench oneshot train lora decode)
for p in "${parts[@]}"; do
  case $p in tests|bench|oneshot|train|lora|gentests|decode|triton|kvquant) ;; *) echo "unknown PART '$p'; $usage" >&2; exit 2 ;; esac
done
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the compiled Triton kernels, not the interpreter the CPU suite runs them under
export TRITON_INTERPRET=0
py=python3
# steps run inside pipelines (subshells), so failures are collected in a file, not a variable
failed="$out/failed_steps.txt"
rm -f "$failed"
deadline=${DEADLINE:-0}
step() {
  echo "== $1"; shift
  if [ "$deadline" -gt 0 ] && [ "$SECONDS" -ge "$deadline" ]; then
    echo "SKIPPED (deadline ${deadline}s): $*"; echo "skipped: $*" >> "$failed"; return
  fi
  "$@" || { echo "FAILED ($?): $*"; echo "$*" >> "$failed"; }
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
$py -c "import torch, transformers, peft, lightning; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| lightning', lightning.__version__)" | tee -a "$out/device.txt"

if want tests; then
  step "pytest -m gpu" $py -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/pytest_gpu.log"
fi

base=/tmp/smollm2-random
big=/tmp/llama7b-4layers-random
# written once per machine: several runs in one lease share them. The 7B shape takes over a
# minute on a fresh machine: with the triton part it is written in the background while the
# kernel tests and timings (which need no base) run, and awaited before the first step that does
bases() {
  [ -f "$base/config.json" ] || step "random bases" $py bench/random_base.py .gpu/smollm2-config "$base"
  [ -f "$big/config.json" ] || step "random bases" $py bench/random_base.py .gpu/llama7b-4layers "$big" \
    --dtype bfloat16
}
bases_pid=
if want triton; then bases > "$out/bases.log" 2>&1 & bases_pid=$!; else bases; fi
await_bases() { [ -z "$bases_pid" ] || { wait "$bases_pid"; cat "$out/bases.log"; bases_pid=; }; }
docs=.gpu/docs.jsonl
bench() {  # BASE DTYPE SEQ BATCH [PAIR [EXTRA...]]
  local b=$1 dt=$2 seq=$3 batch=$4 pair=${5:-materialised}; shift 5 2>/dev/null || shift $#
  step "bench_train $pair $b $dt ${seq}x$batch $*" $py bench/bench_train.py \
    --pair "$pair" --device cuda --base "$b" --dtype "$dt" --files "$docs" \
    --seq-len "$seq" --batch "$batch" --steps 6 "$@"
}
want triton && {
  # one tile config per kernel in the tests (autotuning each of their shapes would take minutes)
  step "pytest -m gpu -k triton" timeout 120 env KVGATE_TRITON_AUTOTUNE=0 $py -m pytest -m gpu \
    tests/gpu -q -p no:cacheprovider -k triton --durations=5 2>&1 | tee "$out/pytest_triton.log"
  # the kernel alone against SDPA flash, on each kernel's first tile config (an autotuned pass
  # needs ~100 s per head width first)
  step "bench_kernel --triton (first tile configs)" timeout 180 env KVGATE_TRITON_AUTOTUNE=0 \
    $py bench/bench_kernel.py --device cuda --triton --repeats 10 \
    --shapes 1,32,32,2048,128 1,32,32,4096,128 1,9,3,2048,64 1,9,3,4096,64
} 2>&1 | grep --line-buffered -v "it/s\]" | tee "$out/bench_kernel.log"
await_bases
if want bench; then
  {
    for seq in 1024 2048 4096; do bench "$big" bfloat16 $seq 1; done
    for seq in 1024 2048 3072; do bench "$base" bfloat16 $seq 1; done; bench "$base" bfloat16 256 4
  } 2>&1 | grep --line-buffered -v "it/s\]" | tee "$out/bench_train.log"
fi
# the one-shot recipe's step (prefill full: the prompt once without autograd, the gates on the
# continuation), the shapes of section 8's CPU rows: 4 x 256 with 64 scored, 1 x 1,024 with 256
if want oneshot; then
  oneshot=(--prefill full --recent 16 --sinks 4 --distill-weight 1 --lm-weight 0)
  {
    bench "$base" bfloat16 256 4 materialised --continuation 64 "${oneshot[@]}"
    bench "$base" bfloat16 1024 1 materialised --continuation 256 "${oneshot[@]}"
    bench "$big" bfloat16 2048 1 materialised --continuation 512 "${oneshot[@]}"
  } 2>&1 | grep --line-buffered -v "it/s\]" | tee "$out/bench_oneshot.log"
fi

# runs/ is not in the copy that travels: the runs write where the configs say
common=(--data.source files --data.files "[$docs]" --data.max_docs 300 --data.num_workers 0
        --trainer.max_steps 6 --trainer.val_check_interval 3 --trainer.limit_val_batches 2)
want train && {
  # --overwrite: a rerun on the same machine trains afresh over the last check's checkpoints
  step "train.py cpt_recipe on 1 GPU, bf16-mixed" $py train.py --config cpt_recipe --overwrite \
    --trainer.accelerator gpu --trainer.devices 1 --trainer.precision bf16-mixed \
    --model.dtype bfloat16 --model.base_model "$base" "${common[@]}" --data.seq_len 512
  # the paper's config as written (gates + LoRA, DeepSpeed ZeRO-2, bf16-mixed, gradient
  # checkpointing, 128-wide rotary gates) on the Llama-2-7B-shaped base: SmolLM2's heads are
  # 64 wide, which the config's gate head_dim of 128 rightly refuses
  step "train.py cpt_redpajama (DeepSpeed ZeRO-2) on 1 GPU" $py train.py --config cpt_redpajama \
    --overwrite --trainer.devices 1 --trainer.accumulate_grad_batches 1 "${common[@]}" \
    --model.base_model "$big" --data.seq_len 1024
  for ckpt in runs/cpt_recipe/gated runs/cpt_redpajama/gated; do
    step "infer.py $ckpt on cuda" $py infer.py --checkpoint "$ckpt" --device cuda \
      --prompt "The history of the river begins in the mountains, where" --max-new-tokens 16
  done
} 2>&1 | grep --line-buffered -v "it/s\]" | tee "$out/train.log"

want decode && {
  step "pytest -m gpu -k graph" timeout 60 $py -m pytest -m gpu tests/gpu -q -p no:cacheprovider \
    -k graph
  # the Llama-2-7B layer shape first: the targets are set on it (DECODE_BASES=big|base picks)
  for name in ${DECODE_BASES:-big base}; do
    case $name in big) b=$big ;; base) b=$base ;; *) echo "DECODE_BASES: big or base" >&2; exit 2 ;; esac
    step "bench_decode $b" timeout 200 $py bench/bench_decode.py --device cuda --base "$b" \
      --dtype bfloat16 --prompt 4096 --batch 1 8 32 --decode 32 --regimes dense snapkv adakv \
      gate dense-graph snapkv-graph adakv-graph gate-graph
  done
  # the dense baseline on whatever SDPA backend torch picks (cuDNN's on torch 2.11), at batch 8
  [ "${DECODE_DEFAULT_SDPA:-1}" = 1 ] && step "bench_decode default SDPA" timeout 60 $py bench/bench_decode.py --device cuda \
    --base "$big" --dtype bfloat16 --prompt 4096 --batch 8 --decode 32 --dense-sdpa default
} 2>&1 | grep --line-buffered -v "Loading weights" | tee "$out/bench_decode.log"

want triton && {
  # gates + LoRA against LoRA only as the GPU recipes train (bf16-mixed: the fp32 gates compute
  # in bf16), then the same at 4k without autocast (the gates' matmuls in fp32), then where
  # the time goes: one profiled step of each regime
  lora=(--pair lora --device cuda --base "$big" --dtype bfloat16 --files "$docs" --batch 1
        --triton)
  step "bench_train lora triton bf16-mixed 7B shape" timeout 120 env KVGATE_TRITON_AUTOTUNE=0 \
    $py bench/bench_train.py "${lora[@]}" --steps 4 --precision bf16-mixed --seq-len 2048 4096 8192
  step "bench_train lora triton 32-true 7B shape" timeout 60 env KVGATE_TRITON_AUTOTUNE=0 \
    $py bench/bench_train.py "${lora[@]}" --steps 3 --seq-len 4096
  step "bench_train lora profile 7B shape" timeout 75 env KVGATE_TRITON_AUTOTUNE=0 \
    $py bench/bench_train.py "${lora[@]}" --steps 1 --precision bf16-mixed --seq-len 4096 --profile
  # gates-only against the materialised kernel (met at 2k-8k last time), bf16-mixed
  step "bench_train triton 7B shape" timeout 90 env KVGATE_TRITON_AUTOTUNE=0 $py bench/bench_train.py \
    --pair materialised --device cuda --base "$big" --dtype bfloat16 --files "$docs" --batch 1 \
    --steps 3 --triton --precision bf16-mixed --seq-len 2048 4096
  # last, as the deadline allows: the autotuned kernels (tile configs printed)
  step "bench_kernel --triton autotuned" timeout 240 $py bench/bench_kernel.py --device cuda \
    --triton --repeats 10 --shapes 1,32,32,4096,128 1,9,3,2048,64
} 2>&1 | grep --line-buffered -v "it/s\]" | tee "$out/bench_triton.log"

want kvquant && {
  # the random base's tokens, not SmolLM2's text: speed only (bench_kv_quant --grouping, the key
  # grouping's error, needs real weights: run it on the CPU)
  step "bench_kv_quant $base" timeout 240 $py bench/bench_kv_quant.py --device cuda \
    --dtype bfloat16 --base "$base" --length 4096 --new-tokens 64 --repeats 3 \
    --json "$out/bench_kv_quant.json"
} 2>&1 | grep --line-buffered -v "Loading weights" | tee "$out/bench_kv_quant.log"

if want gentests; then
  step "pytest -m gpu -k generation" timeout 240 $py -m pytest -m gpu tests/gpu -q \
    -p no:cacheprovider -k generation --durations=5 2>&1 | tee "$out/pytest_generation.log"
fi

want lora && {
  bench "$base" float32 1024 1; bench "$base" bfloat16 1024 1 lora; bench "$big" bfloat16 2048 1 lora
} 2>&1 | grep --line-buffered -v "it/s\]" | tee -a "$out/bench_train.log"
if [ -s "$failed" ]; then echo "failed steps:"; cat "$failed"; exit 1; fi
