#!/usr/bin/env bash
# The run behind benchmarks/results/: every workload and strategy, the bucket-size sweep and the
# scaling curves, on a local Ray cluster. About 45 minutes on a 2-core VM; needs ~17 GiB of RAM.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0
weight-sync bench --sweep --scaling --out benchmarks/results "$@"
# Fixed costs (issue 14): W5's latency distribution, W2's thousands of tensors and W1, against
# raw and a bare Ray call to every worker.
weight-sync bench --workloads W1,W2,W5 --strategies weight_sync,raw,ray_call \
  --out benchmarks/results/small "$@"
