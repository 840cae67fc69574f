"""The one DCP save/load without a process group: model, optimizer and caller entries round-trip."""

from __future__ import annotations

import pytest
import torch

from asyncrl.distributed import load_dcp, save_dcp
from asyncrl.model import Transformer, preset_args


def _model_and_optimizer(seed: int) -> tuple[Transformer, torch.optim.Optimizer]:
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def test_model_optimizer_and_extra_entries_round_trip(tmp_path):
    model, opt = _model_and_optimizer(seed=0)
    model(torch.arange(8).unsqueeze(0)).logits.square().mean().backward()
    opt.step()
    save_dcp(tmp_path, model, opt, extra={"trainer": {"step": 7, "note": "x", "rng": torch.arange(3)}})

    other, other_opt = _model_and_optimizer(seed=1)
    template = {"trainer": {"step": 0, "note": "", "rng": torch.zeros(3, dtype=torch.int64)}}
    extra = load_dcp(tmp_path, other, other_opt, extra=template)
    assert extra["trainer"]["step"] == 7 and extra["trainer"]["note"] == "x"
    assert torch.equal(extra["trainer"]["rng"], torch.arange(3))
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    moments = [s["exp_avg"] for s in opt.state.values()]
    loaded = [s["exp_avg"] for s in other_opt.state.values()]
    assert len(loaded) == len(moments) and all(torch.equal(a, b) for a, b in zip(moments, loaded))


def test_model_only_checkpoint_loads_into_a_fresh_model(tmp_path):
    model, _ = _model_and_optimizer(seed=0)
    save_dcp(tmp_path, model)
    other, _ = _model_and_optimizer(seed=1)
    assert load_dcp(tmp_path, other) == {}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))


def test_extra_entries_may_not_shadow_model_or_optimizer(tmp_path):
    model, opt = _model_and_optimizer(seed=0)
    with pytest.raises(ValueError, match=r"may not be named \['optim'\]"):
        save_dcp(tmp_path, model, opt, extra={"optim": {}})
