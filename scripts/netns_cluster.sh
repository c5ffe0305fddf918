#!/usr/bin/env bash
# pdserve across hosts on one Linux machine (root): network namespaces on a bridge, a Ray node
# in each (started by cluster_configs/ray_cluster.yaml's own commands), `pdserve serve` on the
# head with host: null, the API key, TLS and the cluster token (pdserve/bench/netns/).
#   sudo scripts/netns_cluster.sh up [--model embedded] [--kv-transport grpc] [--link-rate 1gbit]
#   sudo scripts/netns_cluster.sh link [--link-rate 1gbit] [--json out.json]   # shaped-link figures
#   sudo scripts/netns_cluster.sh --cleanup [--prefix pdsv-]   # what a killed run left behind
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -f .venv/bin/activate && -z "${VIRTUAL_ENV:-}" ]]; then source .venv/bin/activate; fi
action="${1:-up}"
[[ $# -gt 0 ]] && shift
[[ "$action" == "--cleanup" ]] && action=cleanup
exec python -m pdserve.bench netns-cluster "$action" "$@"
