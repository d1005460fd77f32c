"""What runs weight_sync rather than what it is: the command line (``cli``), the demo, the Ray
cluster job (``ray_job``) and the benchmark harness (``bench``)."""
