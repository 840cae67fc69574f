"""What `asyncrl report` plots: each figure's panels and the metrics.jsonl keys behind its curves.

The keys are those the trainer (asyncrl.trainer.session / mismatch), the orchestrator
(asyncrl.orchestrator.metrics, `"role": "orchestrator"`) and its evals during training
(asyncrl.orchestrator.eval_metrics, `"role": "eval"`, step = the version evaluated) write. A curve
whose key a run never logged is left out; a panel with no curves is named on the page as not
logged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["FIGURES", "FigureSpec", "Line", "Panel", "Records", "is_number"]

Records = dict[str, list[dict]]  # role -> metrics.jsonl records of that role, in file order


@dataclass(frozen=True, kw_only=True)
class Line:
    """One curve: `key` of the records of `role`, drawn against their `step`."""

    role: str
    key: str
    label: str
    style: str = "-"  # matplotlib line style; dashed for a total drawn over its parts
    # records where this returns False are left out (e.g. a KL over zero tokens)
    keep: Callable[[dict], bool] = lambda r: True

    def series(self, records: Records) -> tuple[list[int], list[float]]:
        pts = [
            (r["step"], float(r[self.key]))
            for r in records.get(self.role, [])
            if is_number(r.get(self.key)) and self.keep(r)
        ]
        return [p[0] for p in pts], [p[1] for p in pts]


@dataclass(frozen=True, kw_only=True)
class Panel:
    title: str
    ylabel: str
    lines: Sequence[Line] | Callable[[Records], Sequence[Line]]
    ylim: tuple[float, float] | None = None
    counts: bool = False  # integer ticks from 0 (a flat zero line stays readable)
    absent: str = "(none logged)"  # what the page says when `lines` finds no keys at all

    def curves(self, records: Records) -> list[tuple[Line, list[int], list[float]]]:
        lines = self.lines(records) if callable(self.lines) else self.lines
        return [(ln, *ln.series(records)) for ln in lines if ln.series(records)[0]]

    def keys(self, records: Records) -> list[str]:
        lines = self.lines(records) if callable(self.lines) else self.lines
        return [f"{ln.role}:{ln.key}" for ln in lines] or [self.absent]


@dataclass(frozen=True, kw_only=True)
class FigureSpec:
    name: str  # PNG file stem
    title: str
    caption: str
    panels: Sequence[Panel] = field(default_factory=tuple)


def is_number(v: object) -> bool:
    """A finite int or float (not a bool): a value that can be plotted."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _has_current_tokens(r: dict) -> bool:
    return r.get("mismatch_tokens_stale_fraction", 0.0) < 1.0


def _has_stale_tokens(r: dict) -> bool:
    return r.get("mismatch_tokens_stale_fraction", 1.0) > 0.0


def _per_env_rewards(records: Records) -> list[Line]:
    keys = sorted({k for r in records.get("orchestrator", []) for k in r if k.startswith("reward/")})
    envs = [k for k in keys if k not in ("reward/mean", "reward/batch_mean")]
    return [Line(role="orchestrator", key=k, label=f"env {k[7:]}") for k in envs] if len(envs) > 1 else []


_EVAL_CURVES = {"reward": "sampled reward", "pass@1": "pass@1", "greedy_reward": "greedy reward"}


def _eval_lines(records: Records) -> list[Line]:
    """Per eval env: sampled reward, pass@1, pass@k and greedy reward (env named when several)."""
    keys = sorted(
        {k for r in records.get("eval", []) for k in r if k.startswith("eval/") and k.count("/") == 2}
    )
    envs = list(dict.fromkeys(k.split("/")[1] for k in keys))
    lines = []
    for env in envs:
        names = [k.split("/")[2] for k in keys if k.startswith(f"eval/{env}/")]
        pass_k = [n for n in names if n.startswith("pass@") and n != "pass@1"]
        for name in [*_EVAL_CURVES, *pass_k]:
            if name in names:
                label = _EVAL_CURVES.get(name, name)
                lines.append(
                    Line(
                        role="eval",
                        key=f"eval/{env}/{name}",
                        label=f"{env} {label}" if len(envs) > 1 else label,
                    )
                )
    return lines


def _routing_layers(records: Records) -> list[Line]:
    keys = {k for r in records.get("trainer", []) for k in r if k.startswith("routing_agreement/layer_")}
    ordered = sorted(keys, key=lambda k: int(k.rsplit("_", 1)[1]))
    return [Line(role="trainer", key=k, label=f"layer {k.rsplit('_', 1)[1]}") for k in ordered]


_ORCH, _TRAIN = "orchestrator", "trainer"

FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec(
        name="reward",
        title="Training reward and held-out evals",
        caption="Left: mean reward per orchestrator step, of every episode finished since the last batch "
        "and of the samples in the trained batch. Right: the evals during training ([orchestrator.eval]) "
        "on each env's held-out tasks, at the policy version evaluated (step n: the weights trainer "
        "step n produced): reward and pass@1 of the samples at the training temperature, pass@k, and "
        "the greedy reward.",
        panels=(
            Panel(
                title="reward",
                ylabel="mean reward",
                lines=lambda rec: [
                    Line(role=_ORCH, key="reward/mean", label="finished episodes"),
                    Line(role=_ORCH, key="reward/batch_mean", label="trained batch"),
                    *_per_env_rewards(rec),
                ],
            ),
            Panel(
                title="held-out eval",
                ylabel="reward / pass rate",
                lines=_eval_lines,
                absent="no eval lines: set [orchestrator.eval] interval",
            ),
        ),
    ),
    FigureSpec(
        name="mismatch",
        title="Trainer-inference mismatch",
        caption="Mean k3 KL(mu || pi) over sampled tokens, split by policy version: tokens sampled by the "
        "trainer's current weights measure the engine mismatch alone, stale tokens add off-policy drift. "
        "Steps without tokens of a kind are left out of its curve.",
        panels=(
            Panel(
                title="mismatch KL",
                ylabel="k3 KL",
                lines=(  # the total first, so that its parts are drawn over it
                    Line(role=_TRAIN, key="mismatch_kl", label="all tokens", style="--"),
                    Line(
                        role=_TRAIN,
                        key="mismatch_kl_current",
                        label="current-version tokens",
                        keep=_has_current_tokens,
                    ),
                    Line(role=_TRAIN, key="mismatch_kl_stale", label="stale tokens", keep=_has_stale_tokens),
                ),
            ),
            Panel(title="routing agreement per MoE layer", ylabel="agreement", lines=_routing_layers),
        ),
    ),
    FigureSpec(
        name="dropped",
        title="Dropped and failed",
        caption="Cumulative counts: groups dropped for staleness (queued or in flight) or for zero "
        "advantage, episodes that failed and episodes re-run after a server failure.",
        panels=(
            Panel(
                title="dropped groups (cumulative)",
                counts=True,
                ylabel="groups",
                lines=(
                    Line(role=_ORCH, key="dropped/groups_stale_queue", label="stale in queue"),
                    Line(role=_ORCH, key="dropped/groups_stale_in_flight", label="stale in flight"),
                    Line(role=_ORCH, key="dropped/groups_zero_advantage", label="zero advantage"),
                ),
            ),
            Panel(
                title="episodes (cumulative)",
                counts=True,
                ylabel="episodes",
                lines=(
                    Line(role=_ORCH, key="episodes/failed_total", label="failed"),
                    Line(role=_ORCH, key="episodes/retried_total", label="retried"),
                ),
            ),
        ),
    ),
    FigureSpec(
        name="inference",
        title="Inference throughput and weight-update pauses",
        caption="Sampled tokens per second over all servers, seen by the orchestrator between two batches, "
        "and the seconds generation was paused to load new weights.",
        panels=(
            Panel(
                title="inference throughput",
                ylabel="tokens / s",
                lines=(Line(role=_ORCH, key="inference/tokens_per_s", label="sampled tok/s"),),
            ),
            Panel(
                title="weight-update pause per step",
                ylabel="seconds",
                lines=(Line(role=_ORCH, key="inference/pause_s", label="paused"),),
            ),
        ),
    ),
    FigureSpec(
        name="trainer",
        title="Trainer throughput and MFU",
        caption="Tokens per second of the optimizer step (all ranks) and model FLOPs utilisation against "
        "the configured or measured peak.",
        panels=(
            Panel(
                title="trainer throughput",
                ylabel="tokens / s",
                lines=(Line(role=_TRAIN, key="tokens_per_s", label="tok/s"),),
            ),
            Panel(title="MFU", ylabel="fraction of peak", lines=(Line(role=_TRAIN, key="mfu", label="MFU"),)),
        ),
    ),
    FigureSpec(
        name="prefix_cache",
        title="Prefix-cache hit rate",
        caption="Share of prompt tokens served from the inference servers' prefix cache.",
        panels=(
            Panel(
                title="prefix-cache hit rate",
                ylabel="hit rate",
                ylim=(0.0, 1.05),
                lines=(Line(role=_ORCH, key="inference/prefix_hit_rate", label="hit rate"),),
            ),
        ),
    ),
)
