#!/bin/sh
# Regenerate bunshin/server/e2b/envd/gen/*_pb2.py from E2B's envd .proto files (committed beside
# them). Needs grpcio-tools matching the protobuf runtime's major version (5.x: grpcio-tools 1.68),
# e.g. `pip install --target /tmp/protoc grpcio-tools==1.68.1` and PROTOC_PY=/tmp/protoc.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
d=$here/bunshin/server/e2b/envd
PYTHONPATH=${PROTOC_PY:-} python3 -m grpc_tools.protoc -I "$d/proto" --python_out="$d/gen" --pyi_out="$d/gen" \
    "$d/proto/process/process.proto" "$d/proto/filesystem/filesystem.proto"
