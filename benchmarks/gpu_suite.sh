#!/usr/bin/env bash
# Everything that needs a GPU, in one run: the GPU tests (tests/gpu, marked `gpu`), then the GPU
# benchmark (benchmarks/gpu.py). Results and logs go to benchmarks/results/gpu/.
#
# Needs an NVIDIA GPU, a CUDA build of torch, and weight_sync's own dependencies except Ray (the
# tests and the bench import nothing from Ray):
#   pip install --no-deps -e . && pip install pydantic numpy pytest pytest-timeout
# One GPU runs everything but the NCCL group of several ranks (the bench's `nccl` case and
# tests/gpu/test_cuda.py's two-rank test need two GPUs; they are skipped or left out on one).
set -uo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/gpu
mkdir -p "$out"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} > "$out/environment.txt" 2>&1
python -m pytest tests/gpu -m gpu -v -p no:cacheprovider --junitxml="$out/tests.xml" 2>&1 | tee "$out/tests.txt"
tests=${PIPESTATUS[0]}
python benchmarks/gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench.txt"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
exit $(( tests != 0 || bench != 0 ))
