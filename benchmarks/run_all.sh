#!/usr/bin/env bash
# The run behind benchmarks/results/ and the docs' performance page, in one invocation on one
# local Ray cluster: every workload (W1-W5) and strategy, the bucket-size sweep, the scaling
# curves, the safety options, workers on the trainer's host (the shared-memory ring) and delta
# pushes. About an hour on a 2-core VM; needs ~17 GiB of RAM. Add `--address auto` to use an
# existing cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0
weight-sync bench --sweep --scaling --options --same-host W1,W3,W4 --delta \
  --out benchmarks/results "$@"
# The docs' performance page shows the plots beside it (MkDocs reads nothing outside docs/).
cp benchmarks/results/{workloads,buckets,scaling}.png docs/performance/
