"""`asyncrl rl`'s [inference], [orchestrator] and [trainer] are typed: mistakes fail as the file is read."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import RLConfig
from asyncrl.config.trainer import MISLossConfig, RLTrainerConfig


def _load(**sections) -> RLConfig:
    return load_config(RLConfig, {"model": "m", "run_dir": "r"} | sections)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"orchestrator": {"batch_sise": 8}},
            r"unknown key 'orchestrator.batch_sise' \(did you mean 'batch_size'\?\)",
        ),
        (
            {"inference": {"max_num_seq": 8}},
            r"unknown key 'inference.max_num_seq' \(did you mean 'max_num_seqs'\?\)",
        ),
        ({"trainer": {"optim": {"learning_rate": 1e-4}}}, r"unknown key 'trainer.optim.learning_rate'"),
        (
            {"orchestrator": {"batch_size": "many"}},
            r"'orchestrator.batch_size': Input should be a valid integer",
        ),
        (
            {"orchestrator": {"group_size": 0}},
            r"'orchestrator.group_size': Input should be greater than or equal to 1",
        ),
        ({"inference": {"device": "gpu"}}, r"'inference.device': Input should be 'auto', 'cpu' or 'cuda'"),
        (
            {"trainer": {"model": {"device": "gpu"}}},
            r"'trainer.model.device': Input should be 'auto', 'cpu' or 'cuda'",
        ),
        (
            {"trainer": {"loss": {"variant": "trust_region", "mis_low": 0.3}}},
            r"unknown key 'trainer.loss.mis_low': it belongs to variant = 'mis', and this table's variant is "
            r"'trust_region'",
        ),
        (
            {"trainer": {"loss": {"variant": "ppo"}}},
            r"'trainer.loss.variant': 'ppo' is not one of 'trust_region'",
        ),
    ],
)
def test_section_mistakes_fail_as_the_config_is_read(sections, message):
    with pytest.raises(ConfigError, match=message):
        _load(**sections)  # before resolve()


def test_sections_hold_only_what_they_set_and_resolve_fills_the_rest(tmp_path):
    cfg = _load(
        inference={"backend": "vllm"},
        orchestrator={"batch_size": 8, "group_size": 4},
        trainer={"loss": {"variant": "mis", "mis_low": 0.3}, "model": {"dtype": "bfloat16"}},
    )
    assert cfg.orchestrator.batch_size == 8 and cfg.trainer.loss.mis_low == 0.3
    r = cfg.resolve()
    assert isinstance(r.trainer.loss, MISLossConfig) and r.trainer.loss.mis_low == 0.3
    assert (str(r.trainer.model.path), r.trainer.model.dtype, r.trainer.model.device) == (
        "m",
        "bfloat16",
        "auto",
    )
    # defaults resolve() derives are not shadowed by the section's own defaults
    assert r.orchestrator.return_routed_experts is False  # a vLLM server without routed experts
    assert r.inference[0].update_weights_roots and r.inference[0].update_weights_roots[0].endswith(
        "r/weights"
    )


def test_every_command_defaults_to_one_run_dir_and_seq_len():
    rl = RLConfig(model="m")
    orchestrator = OrchestratorConfig(model="m")
    trainer = load_config(RLTrainerConfig, {"model": {"path": "m"}, "max_steps": 1})
    assert rl.run_dir == orchestrator.run_dir == str(trainer.run_dir) == "outputs/run"
    assert rl.seq_len == orchestrator.seq_len == trainer.seq_len


@pytest.mark.parametrize(
    ("nproc", "parallel", "dp_size"),
    [
        (1, {}, 1),
        (4, {}, 4),  # dp_shard = -1 takes the whole world
        (4, {"cp": 2}, 2),  # the CP ranks of one group read one part
        (8, {"dp_replicate": 2, "cp": 2}, 4),
        (8, {"dp_shard": 2, "cp": 2, "ep": 2, "dp_replicate": 2}, 4),  # EP borrows ranks, reads nothing
    ],
)
def test_the_orchestrator_writes_one_part_per_trainer_data_rank(nproc, parallel, dp_size):
    cfg = _load(deployment={"trainer_nproc": nproc}, trainer={"parallel": parallel})
    assert cfg.resolve().orchestrator.trainer_dp_size == dp_size


def test_a_given_trainer_world_size_replaces_trainer_nproc():
    cfg = _load(deployment={"trainer_nproc": 1}, trainer={"parallel": {"cp": 2}})
    assert cfg.resolve(trainer_world_size=16).orchestrator.trainer_dp_size == 8  # asyncrl slurm's GPUs


def test_trainer_dp_size_is_derived_never_set_in_the_orchestrator_section():
    assert OrchestratorConfig(model="m").trainer_dp_size == 1  # the standalone orchestrator's default
    with pytest.raises(
        ConfigError, match=r"sets trainer_dp_size \(from \[trainer.parallel\] and the trainer"
    ):
        _load(orchestrator={"trainer_dp_size": 2})
