#!/usr/bin/env bash
# The main job: set up (idempotent), then run the demo. Extra arguments go to the demo.
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$KVGATE_ROOT"
python -m kvgate.demo "$@"
