"""Step metrics: FLOP accounting, a measured matmul peak for MFU, peak memory, and the log sink.

Each step appends one `"role": "trainer"` line to RUN/metrics.jsonl (through
`asyncrl.transport.MetricsWriter`, the file's one writer), mirrors it to the enabled metric sinks,
and prints one console line; on a terminal a progress bar with ETA replaces the lines. A resumed
trainer logs its checkpoint's step with `log_missing`, which skips a line the file already holds.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from asyncrl.model import ModelArgs
from asyncrl.model.compute import linear
from asyncrl.transport.metrics import MetricsWriter
from asyncrl.transport.sinks import Sinks

__all__ = ["MetricsLogger", "flops_per_token", "measure_matmul_peak", "peak_memory_bytes"]


def flops_per_token(args: ModelArgs, mean_context: float) -> float:
    """Training FLOPs per token (forward + backward) for the active parameters and causal attention.

    6 * active non-embedding parameters (the LM head counts, the embedding lookup does not), plus
    attention scores and values: 2 matmuls * 2 FLOPs * 3 (fwd+bwd) * heads * head_dim * context,
    where `mean_context` is the mean number of keys a token attends to (about T/2 when causal).
    """
    dense = args.num_params(active=True) - args.vocab_size * args.hidden_size
    attn = 12 * args.num_hidden_layers * args.num_attention_heads * args.head_dim * mean_context
    return 6.0 * dense + attn


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5
) -> float:
    """Achieved FLOP/s of a square matmul on this device; the MFU denominator when none is configured.

    The matmul goes through `asyncrl.model.compute.linear`, the path the model's own matmuls take:
    on a CPU without native bf16 kernels a bf16 peak is then the fp32 one (less the casts), not
    torch's ~100x slower reference loop.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        linear(a, b)
    _sync(device)
    iters, start = 0, time.perf_counter()
    while True:
        linear(a, b)
        iters += 1
        if iters % 4 == 0:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2.0 * size**3 * iters / elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA) or the process's peak resident set size (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


_CONSOLE_KEYS = (
    "loss",
    "entropy",
    "mismatch_kl",
    "mismatch_kl_stale",
    "routing_agreement",
    "masked_fraction",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "mfu",
    "peak_memory_gb",
    "staleness_mean",
    "staleness_max",
    "reward_mean",
    "wait_s",
    "publish_s",
)


class MetricsLogger:
    """Appends one metrics line per step to RUN/metrics.jsonl and prints a summary (main rank only).

    With `total_steps` and stdout a terminal, the summary is a progress bar (steps, ETA, loss,
    tokens/s); otherwise (logs, CI, under `asyncrl rl`) one plain line per step.
    """

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        *,
        sinks: Sinks | None = None,
        total_steps: int | None = None,
        start_step: int = 0,
    ) -> None:
        self.enabled = enabled
        self._writer = MetricsWriter(run_dir, "trainer") if enabled else None
        self._sinks = sinks or Sinks()
        self._bar = None
        if enabled and total_steps and sys.stdout.isatty():
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        """`record` holds "step" and the step's metrics; the writer adds role and time."""
        if self._writer is None:
            return
        self._sinks.log(self._writer.write(record["step"], record))
        if self._bar is None:
            print(self.format_line(record), flush=True)
            return
        if record.get("skipped"):
            self._bar.write(self.format_line(record))
        postfix = {k: f"{record[k]:.4g}" for k in ("loss", "grad_norm") if k in record}
        if "tokens_per_s" in record:
            postfix["tok/s"] = f"{record['tokens_per_s']:.0f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def log_missing(self, record: dict[str, Any]) -> None:
        """Log `record` unless metrics.jsonl already has its step's line; the bar does not advance,
        since a resumed bar starts at that step."""
        if self._writer is None:
            return
        line = self._writer.write_missing(record["step"], record)
        if line is None:
            return
        self._sinks.log(line)
        if self._bar is None:
            print(self.format_line(record), flush=True)
        else:
            self._bar.write(self.format_line(record))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._sinks.close()

    @staticmethod
    def format_line(record: dict[str, Any]) -> str:
        """The console summary: the headline metrics only (metrics.jsonl has everything)."""
        parts = [f"step {record['step']}"]
        if record.get("skipped"):
            parts.append("SKIPPED (non-finite loss or grad, or no loss tokens; weights unchanged)")
        for key in _CONSOLE_KEYS:
            if key in record:
                value = record[key]
                parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        return " | ".join(parts)
