"""`asyncrl report RUN_DIR [--eval FILE] [--out DIR]`: PNG plots of a run and one static HTML page.

    asyncrl report outputs/reverse_text/rl --eval outputs/reverse_text/eval.jsonl
    # -> outputs/reverse_text/rl/report/index.html (+ one PNG per figure next to it)

Reads RUN/metrics.jsonl (trainer, orchestrator and eval lines; a line without `role` is the
trainer's), the rollout batches under RUN/rollouts/ (token staleness) and, when given or present
as RUN/eval.jsonl, the `asyncrl eval --json-out` results. A figure whose metrics the run did not log
is listed on the page with the keys it looked for, instead of being drawn empty.
"""

from __future__ import annotations

import argparse
import html
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # the object API renders with Agg and keeps no global state
from matplotlib.ticker import MaxNLocator

from asyncrl.run_dir import eval_file as default_eval_file
from asyncrl.run_dir import metrics_file, report_dir
from asyncrl.tools.report_figures import FIGURES, FigureSpec, Records, is_number
from asyncrl.transport.rollouts import batch_steps, read_batch

__all__ = ["ReportError", "load_eval", "load_metrics", "main", "write_report"]

MAX_ROLLOUT_BATCHES = 200  # staleness histogram: at most this many batches, evenly spaced


class ReportError(ValueError):
    """The run directory or an input file cannot be read as a run."""


# -- inputs --------------------------------------------------------------------------------------
def load_metrics(path: Path) -> Records:
    """Records of RUN/metrics.jsonl grouped by `role`; lines without one come from the trainer.

    A final line without its newline is a write in progress and is skipped; any other line that
    is not a JSON object is an error naming its number.
    """
    if not path.is_file():
        raise ReportError(f"{path}: no metrics file (is this a run directory of `asyncrl rl`?)")
    text = path.read_text()
    lines = text.split("\n")
    out: Records = {}
    for num, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if num == len(lines) and not text.endswith("\n"):
                continue
            raise ReportError(f"{path}:{num}: not a JSON line ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ReportError(f"{path}:{num}: expected a JSON object with an integer 'step'")
        out.setdefault(record.get("role", "trainer"), []).append(record)
    return out


def load_eval(path: Path) -> list[dict]:
    """Rows of an `asyncrl eval --json-out` file: label, temperature, reward (and optionally step)."""
    if not path.is_file():
        raise ReportError(f"--eval {path}: file not found")
    rows = []
    for num, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{num}: not a JSON line ({e})") from None
        if not isinstance(row, dict) or not {"label", "temperature", "reward"} <= set(row):
            raise ReportError(f"{path}:{num}: expected keys 'label', 'temperature' and 'reward'")
        if not (is_number(row["reward"]) and is_number(row["temperature"])):
            raise ReportError(f"{path}:{num}: 'reward' and 'temperature' must be finite numbers")
        rows.append(row)
    return rows


def token_staleness(run_dir: Path) -> tuple[np.ndarray, int, int]:
    """Staleness (n - 1 - version) of every loss token of the batches on disk.

    Returns (staleness per token, batches read, batches present); a long run is subsampled to
    MAX_ROLLOUT_BATCHES evenly spaced batches.
    """
    steps = batch_steps(run_dir)
    picked = [steps[int(i)] for i in np.linspace(0, len(steps) - 1, min(len(steps), MAX_ROLLOUT_BATCHES))]
    values = []
    for step in dict.fromkeys(picked):
        batch = read_batch(run_dir, step, timeout_s=0)
        values += [batch.step - 1 - s.policy_versions[s.loss_mask] for s in batch.samples]
    flat = np.concatenate(values) if values else np.zeros(0, np.int64)
    return flat.astype(np.int64), len(dict.fromkeys(picked)), len(steps)


# -- rendering -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Rendered:
    """One section of the page: a PNG, or the reason there is none."""

    title: str
    caption: str
    png: str | None = None
    missing: str | None = None


def _new_figure(num_panels: int) -> tuple[Figure, list]:
    fig = Figure(figsize=(6.2 * num_panels, 3.6), dpi=100, layout="constrained")
    return fig, [fig.add_subplot(1, num_panels, i + 1) for i in range(num_panels)]


def _save(fig: Figure, out_dir: Path, name: str) -> str:
    fig.savefig(out_dir / f"{name}.png")
    return f"{name}.png"


def render_spec(spec: FigureSpec, records: Records, out_dir: Path) -> Rendered:
    """Draw the panels that have data; name the keys of those that have none."""
    drawn = [(p, p.curves(records)) for p in spec.panels]
    absent = [p for p, curves in drawn if not curves]
    note = "; ".join(f"{p.title}: not logged ({', '.join(p.keys(records))})" for p in absent)
    drawn = [(p, c) for p, c in drawn if c]
    if not drawn:
        return Rendered(title=spec.title, caption=spec.caption, missing=note)
    fig, axes = _new_figure(len(drawn))
    for ax, (panel, curves) in zip(axes, drawn):
        for line, steps, values in curves:
            marker = "o" if len(steps) < 30 else None
            ax.plot(steps, values, line.style, marker=marker, markersize=3, label=line.label)
        ax.set(title=panel.title, xlabel="step", ylabel=panel.ylabel)
        if panel.ylim:
            ax.set_ylim(*panel.ylim)
        if panel.counts:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylim(0, max(1.0, max(max(v) for _, _, v in curves)) * 1.05)
        ax.grid(alpha=0.3)
        if len(curves) > 1:
            ax.legend(fontsize=8)
    caption = spec.caption + (f" Missing: {note}." if note else "")
    return Rendered(title=spec.title, caption=caption, png=_save(fig, out_dir, spec.name))


def render_staleness(run_dir: Path, records: Records, out_dir: Path) -> Rendered:
    title = "Staleness"
    staleness, num_read, num_present = token_staleness(run_dir)
    if staleness.size:
        values, counts = np.unique(staleness, return_counts=True)
        caption = (
            f"Loss tokens by staleness n - 1 - version (0 = sampled by the weights trained at step n - 1), "
            f"over {staleness.size} tokens of {num_read} of the {num_present} batches in rollouts/."
        )
        xlabel, ylabel = "staleness (policy versions)", "tokens"
    else:
        per_step = [
            r["staleness/max"] for r in records.get("orchestrator", []) if is_number(r.get("staleness/max"))
        ]
        if not per_step:
            return Rendered(
                title=title,
                caption="",
                missing="no batches under rollouts/ and no orchestrator 'staleness/max' in metrics.jsonl",
            )
        values, counts = np.unique(np.asarray(per_step, np.int64), return_counts=True)
        caption = "rollouts/ holds no batches; steps by their batch's largest token staleness instead."
        xlabel, ylabel = "max staleness in the batch (policy versions)", "steps"
    fig, (ax,) = _new_figure(1)
    ax.bar(values, counts, width=0.8, color="tab:purple")
    ax.set(title="staleness histogram", xlabel=xlabel, ylabel=ylabel, xticks=values)
    ax.grid(alpha=0.3, axis="y")
    return Rendered(title=title, caption=caption, png=_save(fig, out_dir, "staleness"))


def render_eval(rows: list[dict] | None, out_dir: Path) -> Rendered:
    title = "Eval reward"
    if not rows:
        why = "no eval file (pass --eval FILE, written by `asyncrl eval --json-out`)" if rows is None else ""
        return Rendered(title=title, caption="", missing=why or "the eval file has no rows")
    temps = sorted({float(r["temperature"]) for r in rows})
    fig, (ax,) = _new_figure(1)
    if all(is_number(r.get("step")) for r in rows):  # evals of checkpoints along the run
        for t in temps:
            pts = sorted((r["step"], r["reward"]) for r in rows if float(r["temperature"]) == t)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"temperature {t:g}")
        ax.set(xlabel="step")
    else:  # one row per model label (e.g. the SFT start point and the RL result)
        labels = list(dict.fromkeys(str(r["label"]) for r in rows))
        width = 0.8 / len(temps)
        for i, t in enumerate(temps):
            by_label = {str(r["label"]): r["reward"] for r in rows if float(r["temperature"]) == t}
            xs = [j + (i - (len(temps) - 1) / 2) * width for j, lb in enumerate(labels) if lb in by_label]
            ys = [by_label[lb] for lb in labels if lb in by_label]
            bars = ax.bar(xs, ys, width=width * 0.95, label=f"temperature {t:g}")
            ax.bar_label(bars, fmt="%.3f", fontsize=8)
        ax.set_xticks(range(len(labels)), labels)
    lo = min(0.0, *(float(r["reward"]) for r in rows))
    hi = max(0.0, *(float(r["reward"]) for r in rows))
    # headroom above the bars for the legend and the value labels
    ax.set(title="eval reward", ylabel="mean reward", ylim=(lo, hi + 0.3 * (hi - lo) if hi > lo else 1.0))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper center", ncols=len(temps))
    tasks = sorted({r.get("num_tasks") for r in rows if r.get("num_tasks")})
    caption = "Mean reward on held-out tasks" + (f" ({', '.join(map(str, tasks))} tasks)." if tasks else ".")
    return Rendered(title=title, caption=caption, png=_save(fig, out_dir, "eval"))


# -- page ----------------------------------------------------------------------------------------
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; padding: 0 1.5em; max-width: 1280px;
       color: #222; }
section { margin-bottom: 2em; } img { max-width: 100%; border: 1px solid #ddd; }
.missing { color: #a33; background: #fdf2f2; padding: .6em 1em; border-left: 4px solid #c55; }
table { border-collapse: collapse; } td { padding: .15em 1.2em .15em 0; }
"""


def _summary(records: Records) -> list[tuple[str, str]]:
    orch, train = records.get("orchestrator", []), records.get("trainer", [])
    rows = [("trainer steps logged", str(len(train))), ("orchestrator steps logged", str(len(orch)))]
    rewards = [r["reward/mean"] for r in orch if is_number(r.get("reward/mean"))]
    if rewards:
        k = max(1, len(rewards) // 4)
        rows.append(
            (
                f"training reward, first / last {k} steps",
                f"{np.mean(rewards[:k]):.3f} / {np.mean(rewards[-k:]):.3f}",
            )
        )
    return rows + _eval_summary(records.get("eval", []))


def _eval_summary(evals: list[dict]) -> list[tuple[str, str]]:
    """Per eval env: pass@1 at the first and the last version evaluated."""
    evals = sorted(evals, key=lambda r: r["step"])
    keys = dict.fromkeys(k for r in evals for k in r if k.startswith("eval/") and k.endswith("/pass@1"))
    rows = []
    for key in keys:
        points = [(r["step"], r[key]) for r in evals if is_number(r.get(key))]
        (v0, first), (v1, last) = points[0], points[-1]
        rows.append((f"held-out {key.split('/')[1]} pass@1, v{v0} / v{v1}", f"{first:.3f} / {last:.3f}"))
    return rows


def render_page(run_dir: Path, records: Records, sections: list[Rendered]) -> str:
    esc = html.escape
    table = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in _summary(records))
    body = []
    for s in sections:
        if s.png:
            inner = f'<img src="{esc(s.png)}" alt="{esc(s.title)}"><p>{esc(s.caption)}</p>'
        else:
            inner = f'<p class="missing">Not in this run: {esc(s.missing or "")}</p>'
        body.append(f"<section><h2>{esc(s.title)}</h2>{inner}</section>")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>asyncrl report: '
        f"{esc(run_dir.name)}</title><style>{_CSS}</style></head><body>"
        f"<h1>asyncrl report</h1><p>run: <code>{esc(str(run_dir.resolve()))}</code></p><table>{table}</table>"
        + "".join(body)
        + "</body></html>\n"
    )


def write_report(run_dir: Path, out_dir: Path | None = None, eval_file: Path | None = None) -> Path:
    """Render every figure of `run_dir` into `out_dir` (default RUN/report); returns index.html."""
    records = load_metrics(metrics_file(run_dir))
    if eval_file is None and default_eval_file(run_dir).is_file():
        eval_file = default_eval_file(run_dir)
    eval_rows = load_eval(eval_file) if eval_file is not None else None
    out_dir = out_dir or report_dir(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reward, *rest = (render_spec(spec, records, out_dir) for spec in FIGURES)
    sections = [reward, render_eval(eval_rows, out_dir), *rest, render_staleness(run_dir, records, out_dir)]
    index = out_dir / "index.html"
    index.write_text(render_page(run_dir, records, sections))
    return index


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="run directory of `asyncrl rl` (holds metrics.jsonl)")
    p.add_argument(
        "--eval",
        type=Path,
        default=None,
        help="`asyncrl eval --json-out` file (default: RUN/eval.jsonl if present)",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (default: RUN/report)")
    args = p.parse_args(argv)
    try:
        index = write_report(args.run_dir, args.out, args.eval)
    except ReportError as e:
        p.error(str(e))
    print(f"report: {index}")
    return 0
