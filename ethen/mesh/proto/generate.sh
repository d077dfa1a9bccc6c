#!/usr/bin/env bash
# Regenerate mesh_pb2.py / mesh_pb2_grpc.py / mesh_pb2.pyi from mesh.proto (run from anywhere).
# The generated grpc module imports `mesh_pb2` as a top-level module; it is rewritten to a relative import so the
# package works installed or from a checkout.
set -euo pipefail
root="$(cd "$(dirname "$0")/../../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
cd "$root"
"$py" -m grpc_tools.protoc -I ethen/mesh/proto --python_out=ethen/mesh/proto --pyi_out=ethen/mesh/proto \
    --grpc_python_out=ethen/mesh/proto ethen/mesh/proto/mesh.proto
sed -i 's/^import mesh_pb2 as mesh__pb2$/from . import mesh_pb2 as mesh__pb2/' ethen/mesh/proto/mesh_pb2_grpc.py
