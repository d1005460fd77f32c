"""Real vLLM engines (the CPU build) as Ray actors, shared by the tests of this folder.

Starting one costs 40-80 s of the 2 cores here (three processes, each importing vLLM), so the
engines start together, once for this folder, and tests push whatever they need into them: every
test begins with a full push of its own, never relying on what an earlier one left behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import ray

from tests.vllm.models import LLAMA, LONG, QWEN2, Trainer, engine_options, save

vllm = pytest.importorskip("vllm", reason="the real-vLLM tests need the vllm extra")

from weight_sync.adapters.vllm import RemoteVLLMEngine

READY_S = 600  # engines start together on 2 cores
# Single-rank engines leave OpenMP threads unbound (vLLM's automatic binding would pin every
# engine to the same core); the tensor-parallel engine gives each worker a core of its own.
UNBOUND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
TWO_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _start(options: dict, env: dict[str, str], **engine: object) -> object:
    return RemoteVLLMEngine.options(num_cpus=0, runtime_env={"env_vars": env}).remote(
        **engine, **options
    )


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": save(QWEN2, root / "qwen2", seed=0),
        "llama": save(LLAMA, root / "llama", seed=0),
    }


@pytest.fixture(scope="package")  # stopped once the folder is done: others need the memory
def engines(ray_cluster: None, model_dirs: dict[str, str]) -> Iterator[dict[str, object]]:
    """qwen2: offline LLM, float32, tied embeddings; llama: AsyncLLM, float32, untied;
    qwen2_tp2_bf16: offline LLM, bfloat16, tensor parallelism 2 (one worker per core); native:
    a plain vllm.LLM with weight_sync as its weight-transfer backend (no VLLMEngine)."""
    from tests.vllm.native_llm import NativeLLM  # here: it imports vLLM's engine (~3 s)

    started = {
        "qwen2": _start(engine_options(model_dirs["qwen2"]), UNBOUND),
        "llama": _start(
            engine_options(model_dirs["llama"], max_model_len=LONG + 64), UNBOUND, async_engine=True
        ),
        "qwen2_tp2_bf16": _start(
            engine_options(model_dirs["qwen2"], dtype="bfloat16", tensor_parallel_size=2),
            TWO_CORES,
        ),
        "native": ray.remote(num_cpus=0)(NativeLLM)
        .options(runtime_env={"env_vars": UNBOUND})
        .remote(
            **engine_options(model_dirs["qwen2"]), weight_transfer_config={"backend": "weight_sync"}
        ),
    }
    try:
        ray.get([engine.weights_version.remote() if name != "native" else engine.get_weight_version.remote()
                 for name, engine in started.items()], timeout=READY_S)  # fmt: skip
        yield started
    finally:
        shutdowns = [engine.shutdown.remote() for engine in started.values()]
        ray.wait(shutdowns, num_returns=len(shutdowns), timeout=120)
        for engine in started.values():
            ray.kill(engine)


@pytest.fixture
def qwen2(engines: dict[str, object]) -> object:
    return engines["qwen2"]


@pytest.fixture
def llama(engines: dict[str, object]) -> object:
    return engines["llama"]


@pytest.fixture
def qwen2_tp2_bf16(engines: dict[str, object]) -> object:
    return engines["qwen2_tp2_bf16"]


@pytest.fixture
def native(engines: dict[str, object]) -> object:
    return engines["native"]


@pytest.fixture(scope="package")
def trainer_of(ray_cluster: None) -> Iterator[Callable[..., object]]:
    """``trainer_of(config, engines, **options)``: a ``Trainer`` as ``Trainer.remote`` makes it --
    its own model, optimizer and updater -- in one actor that the folder's tests reuse, started
    over for each (``renew``). A test that kills its trainer starts one of its own."""
    held: list = []

    def make(*args: object, **kwargs: object) -> object:
        if held:
            try:
                ray.get(held[0].renew.remote(*args, **kwargs), timeout=120)
                return held[0]
            except ray.exceptions.RayError:  # a failed test left it pushing, or gone
                ray.kill(held.pop())
        held.append(Trainer.remote(*args, **kwargs))
        return held[0]

    try:
        yield make
    finally:
        for actor in held:
            ray.kill(actor)
