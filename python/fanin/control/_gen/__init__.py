"""Generated gRPC stubs of fanin.control.v1 (scripts/gen_proto_py.sh; do not edit)."""
