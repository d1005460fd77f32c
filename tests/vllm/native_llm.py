"""A plain ``vllm.LLM`` as a Ray actor, the way vLLM's own RLHF examples hold one (imported by
the actor's process: vLLM must be installed)."""

from __future__ import annotations

import vllm


class NativeLLM(vllm.LLM):
    """Driven by vLLM's own weight-transfer client; ``shutdown`` stops its processes."""

    def shutdown(self) -> None:
        self.llm_engine.engine_core.shutdown()
