"""The comparison harness behind ``weight-sync bench``: weight_sync against the strategies users
would pick instead, on the same trainer and worker processes, in one run."""
