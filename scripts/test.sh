#!/usr/bin/env bash
# Set up the dev environment, then run every check: ruff, mypy (strict), the test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k codecs -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
bin=.venv/bin
echo "== ruff" && "$bin/ruff" check . && "$bin/ruff" format --check .
# mypy checks the folders under their installed names (see [tool.mypy] in pyproject.toml).
links=.venv/mypy-path/swarmgrad
rm -rf "$links" && mkdir -p "$links"
for pkg in node protocol compression simulations; do ln -s "$PWD/$pkg" "$links/$pkg"; done
echo "== mypy" && "$bin/mypy"
# Two lanes (tests/lanes.py): the swarm tests one after another on one worker, the tests that
# mostly wait on the other; ~20% faster than one lane on two cores. `-n 0` runs one lane.
echo "== pytest" && "$bin/python" -m pytest -n 2 "$@"
