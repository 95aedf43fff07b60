#!/usr/bin/env bash
# Set up the runtime environment, then run the demo. Until the node daemon lands, the demo is
# the codec benchmark on a 16 MiB tensor: every codec, side by side with hivemind's.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python benchmarks/codecs.py --size-mib 16 --repeats 3 "$@"
