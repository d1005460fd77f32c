"""Real SGLang engines (0.5.23, CPU), run with SGLang's own interpreter (see helpers.py).

Without that interpreter the folder is skipped -- except under CI (``CI`` set), where its
absence is a failure: CI installs it (``tests/sglang/install.sh``) and must never go green by
skipping these tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sglang.helpers import sglang_python
from tests.vllm.models import LLAMA, QWEN2, save


@pytest.fixture(scope="session")
def sglang() -> str:
    python = sglang_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("SGLang's interpreter is missing: .ci/run installs it with "
                        "tests/sglang/install.sh (or set WEIGHT_SYNC_SGLANG_PYTHON)")  # fmt: skip
        pytest.skip("no SGLang environment: run `bash tests/sglang/install.sh` first")
    return python


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Checkpoints the engines start from: Qwen2 (tied LM head, q/k/v biases), Llama (untied)."""
    root = tmp_path_factory.mktemp("sglang_models")
    return {
        "qwen2": save(QWEN2, root / "qwen2", seed=0),
        "llama": save(LLAMA, root / "llama", seed=0),
    }


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(
        os.environ.get("WEIGHT_SYNC_SGLANG_LOGS") or tmp_path_factory.mktemp("sglang_logs")
    )
    folder.mkdir(parents=True, exist_ok=True)
    return folder
