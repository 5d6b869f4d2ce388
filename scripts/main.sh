#!/usr/bin/env bash
# The main job on the embedded defaults (SmolLM2-135M, the embedded corpus, the CPU):
#   1. set-up (idempotent: .venv, requirements, the embedded model converted once);
#   2. KVzip+'s labels of 12 training blocks, then the KVzap-style MLP gate regressed on them
#      (configs/cpt_kvzap_quick.yaml), exported to runs/cpt_kvzap_quick/gated;
#   3. `kvgate demo`: one long document compressed once by the full cache, the gate, TOVA and
#      SnapKV at the gate's kept share, three questions asked after compression, one table.
# A rerun reuses the labels and the export; a killed run goes on where it stopped. Extra
# arguments go to `kvgate demo` (e.g. --context-file doc.txt --question "...").
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$KVGATE_ROOT"

kvgate data oracle --config cpt_kvzap_quick
[ -f runs/cpt_kvzap_quick/gated/kvgate_config.json ] ||
  kvgate train --config cpt_kvzap_quick --ckpt_path last
kvgate demo --checkpoint runs/cpt_kvzap_quick/gated "$@"
