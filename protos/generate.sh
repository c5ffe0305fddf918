#!/usr/bin/env bash
# Regenerate the Python modules from the .proto files (committed; a test checks freshness).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/pdserve.proto
