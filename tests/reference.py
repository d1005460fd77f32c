"""The reference an engine's outputs are checked against: a trainer's ``transformers`` model
in the test process, with the weights it last pushed (the vllm-serve and SGLang tests)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from weight_sync.adapters.hf import load_model


class Trainer:
    """A ``transformers`` model with Adam in this process; ``pushed`` is what the engines were
    last sent (as they hold it: cast to ``dtype``), the reference of what they generate."""

    dtype: torch.dtype | None = None

    def __init__(
        self, config: dict[str, Any], seed: int = 1, dtype: torch.dtype | None = None
    ) -> None:
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

    def state(self) -> dict[str, torch.Tensor]:
        """The state dict to push; remembered as the reference once pushed (``landed``)."""
        return self.model.state_dict()

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
