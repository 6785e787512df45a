#!/usr/bin/env bash
# Install everything fanin needs on a fresh Debian machine that has Rust
# (cargo) and Python 3.9+, then build the Rust extension into the Python
# package. Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\033[1msetup:\033[0m %s\n' "$*" >&2; }

command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust (rustup) first" >&2; exit 1; }
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "setup: $PY not found" >&2; exit 1; }

# System packages: a C++ compiler (libFuzzer), iproute2 (network-namespace
# testbed: ip, tc), ethtool (the testbed turns off veth segmentation offloads
# so tbf and byte counters see real frames) and ping (testbed tests, docs).
missing=()
command -v c++ >/dev/null || missing+=(g++)
command -v ip >/dev/null || missing+=(iproute2)
command -v ethtool >/dev/null || missing+=(ethtool)
command -v ping >/dev/null || missing+=(iputils-ping)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "apt-get install ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        say "warning: missing ${missing[*]} (install them with apt-get as root)"
    fi
fi

say "Python packages (requirements-dev.txt)"
PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt

say "building the fanin extension (release) and installing the package"
PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e .
"$PY" -c "import fanin; print('setup: fanin', fanin.__version__, 'ready', flush=True)" >&2

say "building the simulator (fanin sim) and the key-value benchmark (release)"
cargo build -q --release -p fanin-sim --bin fanin-sim
