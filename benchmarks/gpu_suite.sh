#!/usr/bin/env bash
# Everything that needs a GPU, in one run, on whatever GPUs this machine has: the GPU tests
# (tests/gpu, marked `gpu`), the GPU benchmark (benchmarks/gpu.py), and -- where Ray is
# installed -- the demo and the Ray cluster job on those GPUs (with fewer GPUs than actors they
# share them: the colocated deployment). Results and logs go to benchmarks/results/gpu/.
#
# Needs an NVIDIA GPU, a CUDA build of torch, and weight_sync's own dependencies (Ray only for
# the demo and the job; the tests and the bench import nothing from Ray):
#   pip install --no-deps -e . && pip install pydantic numpy pytest pytest-timeout [ray]
# One GPU runs everything but the NCCL group of several ranks (the bench's `nccl` case and
# tests/gpu/test_cuda.py's two-rank test need two GPUs; they are skipped or left out on one).
# Arguments go to benchmarks/gpu.py (e.g. --gib 2 --repeats 5). docs/gpu.md says what ran.
set -uo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/gpu
mkdir -p "$out"
export RAY_USAGE_STATS_ENABLED=0
{
  date -u
  git rev-parse --short HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  python -c "import ray; print('ray', ray.__version__)" 2>/dev/null || echo "ray: not installed"
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"

python -m pytest tests/gpu -m gpu -v -p no:cacheprovider -o addopts="-ra" --junitxml="$out/tests.xml" 2>&1 | tee "$out/tests.txt"
tests=${PIPESTATUS[0]}
python benchmarks/gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench.txt"
bench=${PIPESTATUS[0]}

demo=0 job=0
if python -c "import ray" 2>/dev/null; then
  # The demo as a user runs it, on the GPUs found; then the cluster job with a 1 GB model.
  python -c "from weight_sync.tools.cli import main; raise SystemExit(main(['demo', '--device', 'cuda']))" \
    2>&1 | tee "$out/demo.txt"
  demo=${PIPESTATUS[0]}
  python -m weight_sync.tools.ray_job --workers 7 --size-mb 1024 --pushes 5 --gpus yes 2>&1 | tee "$out/job.txt"
  job=${PIPESTATUS[0]}
else
  echo "skipped: Ray is not installed here (pip install ray to run the demo and the job)" \
    | tee "$out/demo.txt" "$out/job.txt"
fi
echo "tests exit $tests, bench exit $bench, demo exit $demo, job exit $job" | tee "$out/summary.txt"
exit $(( tests != 0 || bench != 0 || demo != 0 || job != 0 ))
