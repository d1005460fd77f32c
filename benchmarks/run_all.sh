#!/usr/bin/env bash
# The run behind benchmarks/results/: every workload and strategy, the bucket-size sweep and the
# scaling curves, on a local Ray cluster. About 45 minutes on a 2-core VM; needs ~17 GiB of RAM.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0
weight-sync bench --sweep --scaling --out benchmarks/results "$@"
