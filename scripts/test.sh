#!/usr/bin/env bash
# The test suite: set up (idempotent), then pytest. Extra arguments go to pytest.
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$KVGATE_ROOT"
python -m pytest "$@"
