"""Shared pytest set-up for small CPU machines.

Many tests start several processes (inference servers, trainer ranks, sandboxes) on 2 cores; one
OpenMP thread per process avoids oversubscription, which made 2-thread runs 10-40x slower under load.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
