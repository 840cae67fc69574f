"""End-to-end RL trainer runs on a tiny HF-format model: publishing, metrics, crash and resume."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from asyncrl.config import load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.model import from_pretrained
from asyncrl.model.fp8 import apply_fp8
from asyncrl.run_dir import batch_dir, weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.mismatch import MismatchGateError
from asyncrl.trainer.rl import run_rl
from asyncrl.trainer.synthetic import synthetic_batch
from asyncrl.transport import STABLE_MARKER, RolloutTimeoutError, stable_steps, write_batch
from asyncrl.wire import BatchFormatError, RolloutBatch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-moe"
    init_model("tiny-moe", path, seed=0)
    return path


def _batches(model_dir, steps: int) -> list[RolloutBatch]:
    model = from_pretrained(model_dir)
    return [
        synthetic_batch(model, step=s, num_samples=6, prompt_len=8, completion_len=16, seed=s)
        for s in range(1, steps + 1)
    ]


def _cfg(model_dir, run_dir, **overrides) -> RLTrainerConfig:
    base = {
        "model": {"path": str(model_dir)},
        "run_dir": str(run_dir),
        "max_steps": 4,
        "seq_len": 64,
        "optim": {"lr": 2e-3},
        "schedule": {"kind": "cosine", "warmup_steps": 1},
        "checkpoint": {"interval": 2},
        "publish": {"keep_last": 2},
        "batch_timeout_s": 0.5,
        "peak_flops": 1e11,
    }
    return load_config(RLTrainerConfig, base | overrides)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_publishes_weights_transformers_can_load(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for b in _batches(model_dir, 3):
        write_batch(tmp_path, b)
    records = run_rl(_cfg(model_dir, tmp_path, max_steps=3))
    assert [r["step"] for r in records] == [1, 2, 3]
    logged = _metrics(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3]
    for key in (
        "loss",
        "entropy",
        "mismatch_kl",
        "masked_fraction",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "mfu",
        "peak_memory_gb",
        "staleness_mean",
        "staleness_max",
    ):
        assert all(np.isfinite(r[key]) for r in logged), key
    assert logged[0]["mismatch_kl"] < 1e-9 and logged[1]["mismatch_kl"] > 0  # batch 2 came from v0, not v1
    assert stable_steps(tmp_path) == [2, 3]
    final = weights_dir(tmp_path, 3)
    assert (final / STABLE_MARKER).is_file() and (final / "tokenizer.json").is_file()

    ours = from_pretrained(final)
    theirs = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ids = torch.tensor([list(b"published weights")])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)
    assert AutoTokenizer.from_pretrained(final).encode("hi", add_special_tokens=False) == [104, 105]
    base = from_pretrained(model_dir)
    assert not torch.equal(base.lm_head.weight, ours.lm_head.weight)


def test_crash_and_resume_matches_the_uninterrupted_run(model_dir, tmp_path):
    batches = _batches(model_dir, 4)
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    for b in batches:
        write_batch(straight, b)
    run_rl(_cfg(model_dir, straight))

    for b in batches[:3]:
        write_batch(crashed, b)
    with pytest.raises(RolloutTimeoutError, match="step 4"):
        run_rl(_cfg(model_dir, crashed))  # dies waiting for batch 4: step 3 done, last checkpoint at 2
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir()) == ["step_2"]
    # A kill in the middle of saving step 3 leaves a directory without DCP's .metadata: not resumable.
    (crashed / "checkpoints" / "step_3").mkdir()
    (crashed / "checkpoints" / "step_3" / "__0_0.distcp").write_bytes(b"partial")
    write_batch(crashed, batches[3])
    resumed = run_rl(_cfg(model_dir, crashed, resume=True))
    assert [r["step"] for r in resumed] == [3, 4]

    want = {r["step"]: r for r in _metrics(straight)}
    for r in resumed:
        assert r["loss"] == want[r["step"]]["loss"], r["step"]
        assert r["grad_norm"] == want[r["step"]]["grad_norm"]
        assert r["lr"] == want[r["step"]]["lr"]
    a, b = from_pretrained(weights_dir(straight, 4)), from_pretrained(weights_dir(crashed, 4))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_resume_step_selects_an_older_checkpoint(model_dir, tmp_path):
    for b in _batches(model_dir, 4):
        write_batch(tmp_path, b)
    first = run_rl(_cfg(model_dir, tmp_path, checkpoint={"interval": 1, "keep_last": 4}))
    again = run_rl(_cfg(model_dir, tmp_path, resume_step=2))
    assert [r["step"] for r in again] == [3, 4]
    assert again[0]["loss"] == first[2]["loss"]
    with pytest.raises(ValueError, match=r"no complete checkpoint at .*step_9"):
        run_rl(_cfg(model_dir, tmp_path, resume_step=9))


def test_batch_with_wrong_routing_shape_names_the_file_and_field(model_dir, tmp_path):
    batch = _batches(model_dir, 1)[0]
    samples = [dataclasses.replace(s, routed_experts=s.routed_experts[:, :3]) for s in batch.samples]
    write_batch(tmp_path, RolloutBatch(step=1, samples=samples))
    with pytest.raises(
        BatchFormatError, match=rf"{batch_dir(tmp_path, 1)}: sample 0: field 'routed_experts'"
    ):
        run_rl(_cfg(model_dir, tmp_path, max_steps=1))


def test_cli_entry_point(model_dir, tmp_path):
    from asyncrl.launcher.cli import main

    write_batch(tmp_path, _batches(model_dir, 1)[0])
    toml = tmp_path / "rl.toml"
    toml.write_text(f'run_dir = "{tmp_path}"\nmax_steps = 1\n[model]\npath = "{model_dir}"\n')
    assert main(["trainer", "@", str(toml), "--seq-len", "64", "--peak-flops", "1e11"]) == 0
    assert stable_steps(tmp_path) == [1]
    shutil.rmtree(tmp_path / "weights")


def test_mismatch_gate_fails_the_run_and_metrics_are_logged(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    (batch,) = _batches(model_dir, 1)
    shifted = [
        dataclasses.replace(
            s, inference_logprobs=np.where(s.loss_mask, s.inference_logprobs - 1.0, 0.0).astype(np.float32)
        )
        for s in batch.samples
    ]
    write_batch(run_dir, RolloutBatch(step=1, samples=shifted))
    cfg = _cfg(model_dir, run_dir, max_steps=2, mismatch={"max_mismatch_kl": 0.1, "gate": "fail"})
    with pytest.raises(MismatchGateError, match=r"step 1: mismatch KL 7\.18\de-01 exceeds"):
        run_rl(cfg)
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["mismatch_kl"] == pytest.approx(np.e - 2, rel=1e-3)  # k3 at log r = 1: e - 1 - 1
    assert record["routing_agreement"] == pytest.approx(1.0)


def test_fp8_training_matches_fp8_inference_logprobs(model_dir, tmp_path):
    """[fp8] on the trainer: logprobs of a batch sampled by the same FP8 model show no mismatch,
    while an fp32 trainer on the same batch does see the precision gap."""
    fp8_model = from_pretrained(model_dir)
    assert apply_fp8(fp8_model, backend="emulated").converted
    batch = synthetic_batch(fp8_model, step=1, num_samples=4, prompt_len=8, completion_len=12, seed=7)
    kl = {}
    for name, fp8 in (("fp8", {"enabled": True, "backend": "emulated"}), ("fp32", {"enabled": False})):
        write_batch(tmp_path / name, batch)
        (record,) = run_rl(_cfg(model_dir, tmp_path / name, max_steps=1, fp8=fp8))
        kl[name] = record["mismatch_kl"]
    assert kl["fp8"] < 1e-6
    assert kl["fp32"] > 100 * max(kl["fp8"], 1e-12)


def _shift(s, by: float):
    lp = np.where(s.loss_mask, s.inference_logprobs - by, 0.0).astype(np.float32)
    return dataclasses.replace(s, inference_logprobs=lp)


@pytest.mark.parametrize("drifted", ["stale", "current"])
def test_mismatch_gate_counts_only_current_version_tokens(model_dir, tmp_path, drifted):
    """Step 2 trains v1. Step 1's batch has no loss tokens, so the step is skipped and v1 = v0: the
    v1 ("current") samples, scored by the base model, are exact. Half the samples carry v0 ("stale")
    tokens. Whichever half is `drifted` gets log r = 1 (k3 = e - 2 = 0.718) on every token."""
    run_dir = tmp_path / "run"
    model = from_pretrained(model_dir)
    empty = synthetic_batch(model, step=1, num_samples=2, prompt_len=8, completion_len=4, seed=1)
    no_loss = [dataclasses.replace(s, loss_mask=np.zeros_like(s.loss_mask)) for s in empty.samples]
    write_batch(run_dir, RolloutBatch(step=1, samples=no_loss))
    current = synthetic_batch(model, step=2, num_samples=4, prompt_len=8, completion_len=16, seed=2).samples
    stale = synthetic_batch(model, step=2, num_samples=4, prompt_len=8, completion_len=16, seed=3, version=0)
    stale = stale.samples
    if drifted == "stale":
        stale = [_shift(s, 1.0) for s in stale]
    else:
        current = [_shift(s, 1.0) for s in current]
    write_batch(run_dir, RolloutBatch(step=2, samples=current + stale))
    cfg = _cfg(model_dir, run_dir, max_steps=2, mismatch={"max_mismatch_kl": 0.1, "gate": "fail"})
    if drifted == "stale":
        records = run_rl(cfg)  # off-policy drift alone does not trip the gate
        assert records[0]["skipped"] and records[1]["mismatch_kl_stale"] == pytest.approx(np.e - 2, rel=1e-3)
        assert records[1]["mismatch_kl_current"] < 1e-9 and records[1]["mismatch_kl"] > 0.1
    else:
        with pytest.raises(MismatchGateError, match=r"step 2: mismatch KL 7\.18\de-01 exceeds") as err:
            run_rl(cfg)
        gated, stale_kl = str(err.value).split("; stale tokens (off-policy drift, not gated): ")
        assert gated.endswith("on tokens sampled by the weights being trained")
        assert float(stale_kl.split(";")[0]) < 1e-6


def test_a_full_disk_stops_the_trainer_with_one_line_and_resume_trains_every_step_once(
    model_dir, tmp_path, monkeypatch, capsys
):
    from asyncrl.launcher.cli import main

    for b in _batches(model_dir, 3):
        write_batch(tmp_path, b)
    real = shutil.disk_usage

    def usage(path):  # once v2 is published, too little space is left for checkpoint 2
        return real(path)._replace(free=3_000_000) if weights_dir(tmp_path, 2).exists() else real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    toml = tmp_path / "rl.toml"
    toml.write_text(f'run_dir = "{tmp_path}"\nmax_steps = 3\n[model]\npath = "{model_dir}"\n')
    flags = ["--seq-len", "64", "--peak-flops", "1e11", "--checkpoint.interval", "1"]
    assert main(["trainer", "@", str(toml), *flags]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("asyncrl trainer:")]
    assert line.startswith(
        "asyncrl trainer: no space left for the checkpoint of step 2 at "
        f"{tmp_path / 'checkpoints' / 'step_2'}: 3.0 MB free on its filesystem, about "
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]

    monkeypatch.undo()  # space freed
    assert main(["trainer", "@", str(toml), *flags, "--resume", "true"]) == 0
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3]
    assert stable_steps(tmp_path) == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "step_3" / ".metadata").is_file()
