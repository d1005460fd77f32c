"""The test suite. Imported before anything of it imports torch (pytest imports this package
ahead of tests/conftest.py), so the settings below reach this process and, through the
environment, every process the suite starts: ranks, Ray's daemons and actors, engines and
servers. A user's own environment wins (``setdefault``).

``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP threads (GNU libgomp) otherwise spin for a while
after every parallel region, waiting for the next. On 2 cores shared by dozens of processes
that spinning is most of their CPU time: three processes doing small matmuls with short gaps
took 22 s and 15 CPU-s each, passive 2.7 s and 1.9 CPU-s (one alone: 3.7 CPU-s against 2.0).

``TORCH_COMPILE_DISABLE=1``: vLLM's sampler wraps two small functions in ``torch.compile``
(the rank of each log-probability, and random sampling), and on the CPU build each engine
process compiles them with inductor on its first request: 2 s of a core with inductor's cache
warm, 11 s on a fresh machine (g++ and a 150 MB precompiled header). Eager they give the same
tokens and log-probabilities (checked on a ``vllm serve`` of the tests' model). Nothing of
weight_sync compiles.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
