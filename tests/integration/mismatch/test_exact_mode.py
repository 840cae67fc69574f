"""Exact on-policy mode: fp32 embedded engine + fp32 trainer code give mismatch KL ~ 0.

A real rollout batch: sampled by `asyncrl.inference.engine.Engine` (fp32, CPU) from a model
written by `init-model`, packed by the trainer's `pack_samples`, scored by the trainer's chunked
logprobs, measured with `asyncrl.trainer.mismatch`.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.config import load_config
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.rl import RLConfig
from asyncrl.distributed import DistInfo
from asyncrl.inference.engine import Engine
from asyncrl.inference.request import SamplingOptions
from asyncrl.model import from_pretrained
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.logprobs import chunked_logprobs
from asyncrl.trainer.mismatch import MismatchSums, mismatch_sums, routing_agreement
from asyncrl.trainer.packing import pack_samples
from asyncrl.trainer.publish import FilesystemWeightPublisher
from asyncrl.wire import RolloutSample


def engine_rollouts(engine: Engine, prompts: list[list[int]], temperature: float) -> list[RolloutSample]:
    opts = SamplingOptions(temperature=temperature, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, opts, return_routed_experts=True)
    tokens, logprobs, routing = {}, {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
            if out.finished:
                routing[out.request_id] = np.asarray(out.routed_experts)
    samples = []
    for i, prompt in enumerate(prompts):
        rid, n_p, n_c = f"r{i}", len(prompt), len(tokens[f"r{i}"])
        samples.append(
            RolloutSample(
                token_ids=np.array(prompt + tokens[rid], np.int32),
                loss_mask=np.array([False] * n_p + [True] * n_c),
                inference_logprobs=np.array([0.0] * n_p + logprobs[rid], np.float32),
                advantages=np.zeros(n_p + n_c, np.float32),
                temperatures=np.full(n_p + n_c, temperature, np.float32),
                policy_versions=np.zeros(n_p + n_c, np.int32),
                routed_experts=routing[rid],
            )
        )
    return samples


def test_fp32_engine_and_fp32_trainer_are_on_policy(tmp_path):
    init_model("tiny-moe", tmp_path / "m", seed=5)
    cfg = InferenceConfig(
        model=str(tmp_path / "m"), dtype="float32", device="cpu", kv_cache_tokens=2048, max_model_len=256
    )
    engine = Engine.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (5, 9, 14, 3, 7, 11)]
    samples = engine_rollouts(engine, prompts[:3], 1.0) + engine_rollouts(engine, prompts[3:], 0.7)

    trainer_model = from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    total, agreements = MismatchSums(), []
    with torch.no_grad():
        for mb in pack_samples(samples, seq_len=64, replay=True):
            out = trainer_model(
                mb.input_ids,
                mb.position_ids,
                routed_experts=mb.routed_experts,
                return_routing=True,
                compute_logits=False,
            )
            lp, _ = chunked_logprobs(
                out.hidden_states[0], trainer_model.lm_head.weight, mb.target_ids, mb.temperatures, 16
            )
            total = total + mismatch_sums(lp, mb.inference_logprobs, mb.loss_mask)
            moe = trainer_model.args.moe_layers
            agreements.append(routing_agreement(mb.routed_experts[0], out.router_topk[0], mb.loss_mask, moe))
    metrics = total.metrics()
    assert total.num_tokens == 6 * 20
    assert metrics["mismatch_kl"] < 1e-6, metrics
    assert metrics["mismatch_kl_max"] < 1e-5, metrics
    assert metrics["mismatch_ratio_outside"] == 0.0
    assert float(torch.cat(agreements).min()) == 1.0  # the trainer's routers pick what inference picked


def _mismatch(engine: Engine, trainer_model, prompts) -> dict:
    samples = engine_rollouts(engine, prompts, 1.0)
    total = MismatchSums()
    with torch.no_grad():
        for mb in pack_samples(samples, seq_len=64, replay=True):
            out = trainer_model(
                mb.input_ids, mb.position_ids, routed_experts=mb.routed_experts, compute_logits=False
            )
            lp, _ = chunked_logprobs(
                out.hidden_states[0], trainer_model.lm_head.weight, mb.target_ids, mb.temperatures, 16
            )
            total = total + mismatch_sums(lp, mb.inference_logprobs, mb.loss_mask)
    return total.metrics()


def test_weights_published_for_fp32_servers_keep_the_run_on_policy(tmp_path):
    """`asyncrl rl` with fp32 servers publishes fp32 (the trainer's weights as they are), so the
    engine samples exactly the trainer's distribution after a weight update too; bf16 files would not."""
    init_model("tiny-moe", tmp_path / "m", seed=5)
    trainer_model = from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    with torch.no_grad():
        for p in trainer_model.parameters():  # a trained version: every weight moved off the base
            p.add_(torch.randn_like(p) * 0.01)
    rl = load_config(RLConfig, {"model": str(tmp_path / "m"), "run_dir": str(tmp_path / "run")}).resolve()
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (5, 9, 14)]
    kl = {}
    for dtype in ("float32", "bfloat16"):
        publish = (
            rl.trainer.publish
            if dtype == "float32"
            else rl.trainer.publish.model_copy(update={"dtype": dtype})
        )
        run_dir = tmp_path / dtype
        publisher = FilesystemWeightPublisher(run_dir, tmp_path / "m", publish, info)
        publisher.publish(trainer_model, 1)
        publisher.wait()
        engine = Engine.from_config(
            rl.inference[0].model_copy(
                update={"device": "cpu", "kv_cache_tokens": 2048, "max_model_len": 256}
            )
        )
        engine.load_weights(engine.read_weights(str(weights_dir(run_dir, 1))), version=1)
        kl[dtype] = _mismatch(engine, trainer_model, prompts)["mismatch_kl"]
    assert rl.trainer.publish.dtype == "float32" and rl.inference[0].dtype == "float32"
    assert kl["float32"] < 1e-10 < 1e-7 < kl["bfloat16"], kl  # bf16 rounding moves logprobs
