#!/usr/bin/env bash
# Set up the runtime environment, then run the demo: a local swarm of 4 real node processes and a
# bootstrap DHT node on loopback training a small GPT on Shakespeare (DiLoCo, 8-bit averaging).
# Extra arguments go to `swarmgrad simulate`, e.g. scripts/demo.sh --nodes 3 --rounds 5
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/swarmgrad simulate --nodes 4 --rounds 10 --out simulation "$@"
