"""`asyncrl init-model`: presets, HF-loadable output, tokenizer, determinism."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.launcher.cli import main
from asyncrl.model import PRESETS, from_pretrained


def test_tiny_moe_preset_size():
    a = PRESETS["tiny-moe"]
    assert 1e6 <= a.num_params() <= 5e6
    assert a.num_experts == 8 and a.num_experts_per_tok == 2
    assert 40e6 <= PRESETS["moe-50m"].num_params() <= 60e6
    assert 0.3e9 <= PRESETS["glm5-350m"].num_params() <= 0.5e9  # GLM-5-shaped, for scale-out benchmarks
    assert 0.45e9 <= PRESETS["moe-500m"].num_params() <= 0.55e9  # Qwen3-MoE-shaped, for weight transfer


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense", "tiny-dsv3", "tiny-glm5", "tiny-glm4moe"])
def test_init_model_writes_hf_model_and_tokenizer(tmp_path, preset, capsys):
    out = tmp_path / preset
    assert main(["init-model", "--preset", preset, "--out", str(out), "--seed", "3"]) == 0
    assert "parameters" in capsys.readouterr().out
    ours = from_pretrained(out)
    held = [*ours.parameters(), *ours.model.buffers()]  # buffers: the routers' correction bias
    assert sum(t.numel() for t in held) == PRESETS[preset].num_params()
    mtp = dict(ours.mtp.named_buffers())  # random MTP layers, for the presets that have them
    if preset == "tiny-glm5":  # a whole decoder layer (8 experts unstacked) + enorm, hnorm, eh_proj, ...
        assert len(mtp) == 49 and mtp["model:layers:4:eh_proj:weight"].shape == (128, 256)
    else:
        assert not mtp
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "abc é"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 257
    assert tok.eos_token_id == ours.args.eos_token_id == 258
    assert len(tok) == ours.args.vocab_size
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (hf(x).logits - ours(x).logits).abs().max() <= 1e-4


def test_seed_controls_weights(tmp_path):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        main(["init-model", "--out", str(tmp_path / name), "--seed", str(seed)])
    a, b, c = (load_file(tmp_path / n / "model.safetensors") for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_refuses_to_overwrite_and_bad_preset(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty"):
        main(["init-model", "--out", str(tmp_path / "x")])
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "init-model", "--preset", "huge", "--out", str(tmp_path / "y")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "invalid choice: 'huge'" in proc.stderr


def test_unknown_command_suggests_nearest(capsys):
    assert main(["init-modle"]) == 2
    assert "did you mean 'init-model'" in capsys.readouterr().err


def test_init_std_scales_the_matrices_not_the_norms(tmp_path):
    for name, std in (("a", "0.02"), ("b", "0.06")):
        main(["init-model", "--out", str(tmp_path / name), "--seed", "1", "--init-std", std])
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in "ab")
    emb = "model.embed_tokens.weight"
    assert abs(b[emb].std().item() - 0.06) < 0.003 and abs(a[emb].std().item() - 0.02) < 0.001
    torch.testing.assert_close(b[emb], 3 * a[emb])  # same seed: the same draw, scaled
    norms = [k for k in a if k.endswith("norm.weight")]
    assert norms and all(torch.equal(b[k], torch.ones_like(b[k])) for k in norms)
    with pytest.raises(ValueError, match="--init-std must be > 0"):
        main(["init-model", "--out", str(tmp_path / "c"), "--init-std", "0"])
