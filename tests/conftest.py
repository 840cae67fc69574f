"""Shared pytest set-up: deterministic, single-threaded-friendly torch on small CPU machines."""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
