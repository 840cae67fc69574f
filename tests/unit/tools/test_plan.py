"""`asyncrl plan`: the all-gather figure of an 800B MoE, the documented GLM-5-scale layout, warnings and
errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.distributed import ParallelDimsError
from asyncrl.inference.kv_cache import KVCache
from asyncrl.model import Transformer, cpu_norm, preset_args
from asyncrl.model.layers import PackedCausalAttention
from asyncrl.tools.plan import GB, Layout, build_plan, load_model_config, main, read_model_config
from asyncrl.tools.plan_trainer import _attention_elements, _layer_unit_params

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configs"
SEED = DOCS / "seed-800b-78l.json"
GLM5 = DOCS / "glm5-scale-moe.json"


def test_seed_figure_one_fp32_layer_is_40gb_and_80gb_with_prefetch():
    args = load_model_config(SEED)
    assert args.num_hidden_layers == 78 and 780e9 < args.num_params() < 830e9
    plan = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=8192, param_dtype="fp32"))
    assert 38 < plan.gathered_layer / GB < 44
    assert 76 < plan.gathered_with_prefetch / GB < 88
    # EP sends tokens instead: each rank gathers only its 1/8 of a layer's experts.
    with_ep = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=8192, param_dtype="fp32", ep=8))
    assert with_ep.gathered_layer < plan.gathered_layer / 6
    assert with_ep.all_to_all_bytes > 0 == plan.all_to_all_bytes


def test_sharded_state_is_16_bytes_per_parameter_over_dp_shard_times_cp():
    args = load_model_config(GLM5)
    plan = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=65536, ep=8, cp=2))
    assert plan.dims.dp_shard == 112
    per_gpu = plan.params + plan.grads + plan.optimizer
    assert per_gpu == pytest.approx(16 * args.num_params() / 224)


def test_documented_glm5_scale_layout_fits_and_checkpointing_matters():
    args = load_model_config(GLM5)
    plan = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=65536, ep=8, cp=2))
    assert plan.fits and plan.total < 141 * GB
    assert plan.activations_ac < plan.activations_no_ac / 10
    no_cp = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=65536, ep=8, cp=1))
    assert not no_cp.fits  # the whole 64k row on one GPU does not fit: CP is what makes it fit


def test_cli_prints_the_table_and_warns_with_exit_1(capsys):
    assert main(["--model", str(GLM5), "--nodes", "28", "--seq-len", "65536", "--ep", "8", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "largest all-gathered layer" in out and "all_to_all sent per GPU per step" in out
    assert main(["--model", str(SEED), "--nodes", "28", "--seq-len", "16384", "--param-dtype", "fp32"]) == 1
    assert "WARNING: does not fit" in capsys.readouterr().out


def test_bad_layouts_name_the_constraint(tmp_path, capsys):
    assert main(["--model", str(GLM5), "--nodes", "2", "--seq-len", "4096", "--ep", "3"]) == 2
    assert "ep (3) must divide num_experts (256)" in capsys.readouterr().err
    with pytest.raises(ParallelDimsError, match=r"seq_len \(1000\) must be a multiple of cp \(3\)"):
        build_plan(load_model_config(GLM5), Layout(nodes=3, gpus_per_node=1, seq_len=1000, cp=3))
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama"}))
    assert main(["--model", str(tmp_path), "--nodes", "1", "--seq-len", "8"]) == 2
    assert "--model" in capsys.readouterr().err


GLM5_PUBLISHED = DOCS / "glm5.json"
KIMI_K2 = DOCS / "kimi-k2.json"


def test_published_glm5_and_kimi_k2_parameter_counts_match_the_announced_figures():
    """GLM-5: 744B total, 40B active (Z.ai counts active parameters without the embedding table
    and LM head; the same rule gives GLM-4.5's 355B / 32B). Kimi-K2: 1.04T total, 32.6B active
    (Moonshot's K2 report, which counts them in). Both configs list the real published shapes."""
    glm5, glm5_notes = read_model_config(GLM5_PUBLISHED)
    kimi, kimi_notes = read_model_config(KIMI_K2)
    layout = Layout(nodes=28, gpus_per_node=8, seq_len=8192, ep=8)
    glm5_plan, kimi_plan = build_plan(glm5, layout), build_plan(kimi, layout)
    assert glm5_plan.total_params == pytest.approx(744e9, rel=0.02)
    assert glm5_plan.active_params_no_embedding == pytest.approx(40e9, rel=0.02)
    assert kimi_plan.total_params == pytest.approx(1.04e12, rel=0.02)
    assert kimi_plan.active_params == pytest.approx(32.6e9, rel=0.02)
    assert glm5.uses_dsa and kimi.uses_mla and not glm5_notes
    assert kimi.model_type == "deepseek_v3" and kimi.rope_scaling.factor == 32.0
    assert len(kimi_notes) == 1 and "quantization_config (fp8)" in kimi_notes[0]
    # the planner's per-layer FSDP units (MLA, indexer, router + bias, shared expert, experts) add
    # up to the model's parameter count
    for args in (glm5, kimi):
        units = sum(_layer_unit_params(args, i, ep=1) for i in range(args.num_hidden_layers))
        assert units + 2 * args.vocab_size * args.hidden_size + args.hidden_size == args.num_params()


def test_published_configs_fit_28_nodes_at_131k_tokens_with_cp_and_checkpointing():
    glm5, kimi = load_model_config(GLM5_PUBLISHED), load_model_config(KIMI_K2)
    at = dict(nodes=28, gpus_per_node=8, seq_len=131072, ep=8)
    assert build_plan(glm5, Layout(**at, cp=8)).fits
    # sparse DSA keeps no [S/cp, S] mask and never expands the row's latent: CP 4 just fits, CP 2 not
    assert build_plan(glm5, Layout(**at, cp=4)).fits
    assert not build_plan(glm5, Layout(**at, cp=2)).fits
    assert not build_plan(glm5, Layout(**at, cp=8, activation_checkpointing=False)).fits
    assert build_plan(kimi, Layout(**at, cp=16)).fits
    assert not build_plan(kimi, Layout(**at, cp=8)).fits


@pytest.mark.parametrize("preset", ["tiny-dsv3", "tiny-glm5", "tiny-moe"])
def test_kv_cache_figure_is_what_the_engine_allocates_per_token(preset):
    """MLA caches the latent + rope key (+ the DSA indexer key), not per-head K/V."""
    args = preset_args(preset)
    cache = KVCache(
        num_layers=args.num_hidden_layers,
        num_blocks=4,
        block_size=8,
        num_kv_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
        routing_top_k=args.routing_top_k,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        latent_dim=args.kv_lora_rank + args.qk_rope_head_dim if args.uses_mla else 0,
        index_dim=args.index_head_dim if args.uses_dsa else 0,
    )
    routing = cache.routing_PLK.numel() * cache.routing_PLK.element_size()
    plan = build_plan(args, Layout(nodes=1, gpus_per_node=1, seq_len=64))
    assert plan.kv_cache_bytes_per_token == (cache.nbytes() - routing) / 32


def test_mla_attention_activation_estimate_is_close_to_what_autograd_keeps():
    """The planner's per-token count for an MLA attention block against the tensors autograd saves
    in one (CPU, 32 tokens, dense path). CPU SDPA keeps its own copies and the probabilities where
    a GPU kernel keeps less, so this checks the size, not the exact list; a GQA formula applied
    to MLA (about 640 per token here) would be far off. RMSNorm runs torch's ops, as on a GPU (the
    CPU kernel of asyncrl.model.cpu_norm keeps less)."""
    args = preset_args("tiny-dsv3")
    model = Transformer(args)
    T = 32
    pos = torch.arange(T)[None]
    rope = model.rotary(pos, torch.float32)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *rope)}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(1, T, args.hidden_size, requires_grad=True)
    layer = model.layers[1]
    cpu_norm.set_enabled(False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            layer.self_attn(layer.input_layernorm(x), rope, PackedCausalAttention(pos))
    finally:
        cpu_norm.set_enabled(True)
    measured = sum(saved.values()) / 4 / T
    local, row = _attention_elements(args, cp=1)
    assert row == 0 and 0.8 < measured / local < 1.25


def test_published_deepseek_v3_config_is_read_with_its_yarn_and_counts_671b():
    """DeepSeek-V3: 671B total, 37B active (DeepSeek's report; its MTP layer not counted)."""
    args, notes = read_model_config(DOCS / "deepseek-v3.json")
    assert args.rope_scaling.factor == 40.0 and args.rope_scaling.mscale_all_dim == 1.0
    assert notes == [
        "quantization_config (fp8) ignored: the plan assumes fp32 master weights and compute in --param-dtype"
    ]
    assert args.num_params() == pytest.approx(671e9, rel=0.01)
    assert args.num_params(active=True) == pytest.approx(37e9, rel=0.02)


def test_context_parallel_attention_is_counted_over_the_whole_row():
    """Under CP each rank's queries attend over the whole gathered row through a boolean mask, which
    SDPA computes in full: halving the tokens per GPU leaves its attention work the same, where a
    causal count would halve it again. At 64k tokens attention is nearly all of tiny-moe's work."""
    args = preset_args("tiny-moe")
    causal = build_plan(args, Layout(nodes=1, gpus_per_node=1, seq_len=65536))
    masked = build_plan(args, Layout(nodes=1, gpus_per_node=2, seq_len=65536, cp=2))
    assert masked.step_flops / causal.step_flops == pytest.approx(1.0, rel=0.01)
