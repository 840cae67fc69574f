"""Evals during training against fake servers and a fake trainer: the eval lines, their separation
from training, the best version kept from pruning, and an eval cut short by a crash redone."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.config.envs import EnvConfig, EnvsConfig
from asyncrl.envs import Environment, Reward, Rubric, Task
from asyncrl.envs.registry import available_envs, register_env
from asyncrl.orchestrator.main import run_orchestrator
from asyncrl.run_dir import weights_dir
from asyncrl.tools.report import write_report
from asyncrl.transport.metrics import read_metrics
from asyncrl.transport.weights import read_keep_set, stable_steps

from .conftest import fake_trainer
from .test_dispatcher import _cfg


class ReplyLengthEnv(Environment):
    """Reward = letters of the reply / 5: with `FakeServer(reply_len=...)`, a reward set per version."""

    name = "reply-length"
    rubric = Rubric(rewards=(Reward(name="len", fn=lambda state: min(1.0, len(state.final_text) / 5)),))

    def task(self, split, index):
        return Task(id=f"reply-length/{split}/{index}", prompt=[{"role": "user", "content": f"say {index}"}])

    def reference(self, task):
        return [{"role": "assistant", "content": "hello"}]


if "reply-length" not in available_envs():
    register_env("reply-length", lambda seed=0: ReplyLengthEnv(seed=seed))

_EVAL = {"interval": 2, "k": 2, "greedy": True, "num_tasks": 3}


async def _run(cfg, *, step_time_s: float = 0.05, keep_last: int | None = None) -> list:
    seen: list = []
    trainer = asyncio.create_task(fake_trainer(cfg.run_dir, cfg.max_steps, seen, step_time_s, keep_last))
    await asyncio.wait_for(run_orchestrator(cfg), timeout=60)
    await asyncio.wait_for(trainer, timeout=10)
    return seen


def test_an_eval_every_2_versions_writes_its_lines_and_stays_out_of_training(
    tmp_path, tokenizer_dir, servers, capsys
):
    (server,) = servers(1)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], eval=_EVAL)
    batches = asyncio.run(_run(cfg))
    lines = read_metrics(cfg.run_dir, "eval")
    assert [(r["step"], r["version"]) for r in lines] == [(0, 0), (2, 2), (4, 4)]  # v4: the final version
    for r in lines:
        assert r["eval/episodes"] == 3 * (2 + 1)
        for key in ("reward", "pass@1", "pass@2", "greedy_reward", "length", "failed", "truncated"):
            assert 0 <= r[f"eval/reverse-text/{key}"] <= (6 if key == "length" else 1), key
        assert r["eval/reverse-text/failed"] == 0 and 0 < r["eval/tokens_on_version"] <= 1
    # eval requests are routed like the others, but never batched and never counted as training's
    trained = [s.episode_id for b in batches for s in b.samples]
    assert trained and not any(e.startswith("eval/") or "/eval/" in e for e in trained)
    counted = sum(r["inference/requests"] for r in read_metrics(cfg.run_dir, "orchestrator"))
    assert counted <= server.num_requests - 3 * 9
    assert [r["groups/dispatched_total"] for r in read_metrics(cfg.run_dir, "orchestrator")][-1] < 50
    out = capsys.readouterr().out
    assert "[orchestrator] eval v2 | reverse-text: reward " in out and " pass@2 " in out
    assert read_keep_set(cfg.run_dir) == {}  # nothing pinned without keep_best once the evals are done
    # `asyncrl report` draws them next to the training reward
    page = write_report(tmp_path / "run").read_text()
    assert '<img src="reward.png"' in page and "held-out eval: not logged" not in page
    assert "held-out reverse-text pass@1, v0 / v4" in page


def test_the_best_version_by_keep_best_survives_pruning_and_is_named(
    tmp_path, tokenizer_dir, servers, capsys
):
    (server,) = servers(1, reply_len=lambda version: 5 if version == 2 else 1)  # v2 is the best
    env = EnvsConfig(envs=[EnvConfig(name="reply-length")])
    cfg = _cfg(
        tmp_path,
        tokenizer_dir,
        [server],
        envs=env,
        max_steps=6,
        advantage={"filter_zero_advantage": False},
        eval=_EVAL | {"keep_best": "eval/reply-length/reward"},
    )
    asyncio.run(_run(cfg, step_time_s=0.3, keep_last=1))
    rewards = {r["version"]: r["eval/reply-length/reward"] for r in read_metrics(cfg.run_dir, "eval")}
    assert rewards == {
        0: pytest.approx(0.2),
        2: pytest.approx(1.0),
        4: pytest.approx(0.2),
        6: pytest.approx(0.2),
    }
    assert stable_steps(cfg.run_dir) == [2, 6]  # keep_last = 1 pruned all but the newest, and the best
    assert read_keep_set(cfg.run_dir) == {2: "best by eval/reply-length/reward (1.0000)"}
    assert f"best version by eval/reply-length/reward: v2 (1.0000), {weights_dir(cfg.run_dir, 2)}" in (
        capsys.readouterr().out
    )


async def _crash_mid_eval(cfg) -> int:
    """Run until an eval past v0 is under way (the keep-set names it, no line yet), then kill the
    orchestrator; returns the version whose eval was cut short."""
    task = asyncio.create_task(run_orchestrator(cfg))
    while True:
        assert not task.done(), task.exception()
        done = {r["version"] for r in read_metrics(cfg.run_dir, "eval")}
        running = [v for v in read_keep_set(cfg.run_dir) if v > 0 and v not in done]
        if running:
            break
        await asyncio.sleep(0.002)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return running[0]


async def _crash_and_resume(cfg, restarted) -> int:
    seen: list = []
    trainer = asyncio.create_task(fake_trainer(cfg.run_dir, cfg.max_steps, seen, 0.2))
    cut = await asyncio.wait_for(_crash_mid_eval(cfg), timeout=60)
    resumed = cfg.model_copy(update={"resume": True, "servers": [restarted.url]})  # a fresh server: v0
    await asyncio.wait_for(run_orchestrator(resumed), timeout=60)
    await asyncio.wait_for(trainer, timeout=10)
    return cut


def test_resume_redoes_an_eval_cut_short_by_a_crash_at_its_own_version(tmp_path, tokenizer_dir, servers):
    server, restarted = servers(2, delay_median_s=0.05)  # an eval lasts long enough to be cut short
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=6, eval=_EVAL)
    cut = asyncio.run(_crash_and_resume(cfg, restarted))
    assert cut in (2, 4, 6)
    # the first thing after the restart: load v<cut> and evaluate it, then the newest weights
    assert restarted.loaded_paths[0] == str(weights_dir(cfg.run_dir, cut).resolve())
    lines = read_metrics(cfg.run_dir, "eval")
    assert sorted(r["version"] for r in lines) == sorted({0, 2, 4, 6} | {cut})  # each version once
    redone = next(r for r in lines if r["version"] == cut)
    assert redone["eval/tokens_on_version"] == 1.0 and redone["eval/newest_version"] == cut  # v<cut> only
    assert {s.version for s in restarted.seen[: redone["eval/episodes"]]} == {cut}
    assert json.loads((tmp_path / "run" / "weights" / "keep.json").read_text()) == {"steps": {}}


def test_a_version_only_sent_to_the_servers_has_no_weights_to_name(tmp_path):
    """The distributed transport publishes most versions as config.json + its manifest, without
    tensors: neither an eval's resume nor keep_best may point at them."""
    from asyncrl.orchestrator.evaluator import best_weights, version_weights
    from asyncrl.transport.metrics import MetricsWriter
    from asyncrl.transport.weights import TRANSFER_MANIFEST, stage_weights

    run_dir = tmp_path / "run"
    for step, sent_only in ((1, False), (2, True)):
        with stage_weights(run_dir, step) as tmp:
            (tmp / "config.json").write_text("{}")
            if sent_only:
                (tmp / TRANSFER_MANIFEST).write_text("{}")
    assert version_weights(run_dir, "base", 1) == weights_dir(run_dir, 1)
    assert version_weights(run_dir, "base", 2) is None
    out = MetricsWriter(run_dir, "eval")
    for version, reward in ((0, 0.1), (1, 0.5), (2, 0.9)):
        out.write(version, {"version": version, "eval/r": reward})
    version, value, path = best_weights(run_dir, "base", "eval/r")
    assert (version, path) == (1, weights_dir(run_dir, 1)) and value == pytest.approx(0.5)
