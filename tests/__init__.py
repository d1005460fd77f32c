"""The test suite. Imported before anything of it imports torch (pytest imports this package
ahead of tests/conftest.py), so the setting below reaches this process's OpenMP runtime and,
through the environment, every process the suite starts: ranks, Ray's daemons and actors,
engines and servers.

``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP threads (GNU libgomp) otherwise spin for a while
after every parallel region, waiting for the next. On 2 cores shared by dozens of processes
that spinning is most of their CPU time: three processes doing small matmuls with short gaps
took 22 s and 15 CPU-s each, passive 2.7 s and 1.9 CPU-s (one alone: 3.7 CPU-s against 2.0).
A user's own environment wins (``setdefault``).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
