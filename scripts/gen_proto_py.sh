#!/usr/bin/env bash
# Regenerate the Python gRPC stubs of the control API
# (proto/fanin/control/v1/control.proto -> python/fanin/control/_gen/).
#
# Needs grpcio-tools (pip install grpcio-tools); it bundles protoc, so no
# system protoc is required. The generated files are committed; rerun this
# after every change to the .proto and commit the result.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
# FANIN_PROTO_PY_OUT redirects the output (the tests use it to check that
# the committed stubs are current).
out="${FANIN_PROTO_PY_OUT:-$root/python/fanin/control/_gen}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Compile with the path relative to proto/ so the descriptor is registered as
# "fanin/control/v1/control.proto" (unique in the process-wide pool).
"$python" -m grpc_tools.protoc \
    -I "$root/proto" \
    --python_out="$tmp" \
    --pyi_out="$tmp" \
    --grpc_python_out="$tmp" \
    "$root/proto/fanin/control/v1/control.proto"

mkdir -p "$out"
gen="$tmp/fanin/control/v1"
cp "$gen/control_pb2.py" "$gen/control_pb2.pyi" "$out/"
# The grpc stub imports its messages by proto path (`from fanin.control.v1
# import control_pb2`), which is not where they live in this package: make
# the import relative.
sed -e 's/^from fanin\.control\.v1 import control_pb2 as /from . import control_pb2 as /' \
    "$gen/control_pb2_grpc.py" >"$out/control_pb2_grpc.py"
grep -q '^from \. import control_pb2 as ' "$out/control_pb2_grpc.py" || {
    echo "gen_proto_py.sh: could not rewrite the import in control_pb2_grpc.py" >&2
    exit 1
}
cat >"$out/__init__.py" <<'PY'
"""Generated gRPC stubs of fanin.control.v1 (scripts/gen_proto_py.sh; do not edit)."""
PY
echo "generated $(cd "$out" && ls control_pb2*.py* | tr '\n' ' ')in ${out#"$root"/}"
