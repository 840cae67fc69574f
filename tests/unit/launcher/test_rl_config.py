"""`asyncrl rl` config resolution, error messages and the commands it would start (--dry-run)."""

from __future__ import annotations

import tomllib

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.rl import RLConfig
from asyncrl.launcher.cli import main
from asyncrl.launcher.run_configs import write_configs


def _cfg(**kw) -> RLConfig:
    return load_config(RLConfig, {"model": "m", "run_dir": "r", "max_steps": 5, "seq_len": 4096} | kw)


def test_shared_keys_reach_every_process():
    cfg = _cfg(
        deployment={"num_inference_servers": 2, "base_port": 9100},
        orchestrator={"batch_size": 8, "group_size": 4},
        trainer={"optim": {"lr": 3e-4}, "model": {"dtype": "bfloat16"}},
        inference={"max_num_seqs": 7},
    )
    r = cfg.resolve()
    assert [i.port for i in r.inference] == [9100, 9101] and all(i.model == "m" for i in r.inference)
    assert r.inference[0].max_num_seqs == 7
    assert r.orchestrator.servers == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert (r.orchestrator.model, r.orchestrator.run_dir, r.orchestrator.max_steps) == ("m", "r", 5)
    assert str(r.trainer.model.path) == "m" and r.trainer.model.dtype == "bfloat16"
    assert (r.trainer.max_steps, r.trainer.seq_len, r.trainer.optim.lr) == (5, 4096, 3e-4)
    assert r.orchestrator.seq_len == 4096 and r.orchestrator.max_model_len is None  # no model dir "m"


def test_section_setting_a_shared_key_is_an_error():
    with pytest.raises(ConfigError, match=r"'orchestrator': sets max_steps \(a top-level key\)"):
        _cfg(orchestrator={"max_steps": 3})
    with pytest.raises(ConfigError, match=r"'trainer': sets model.path \(from the top-level model\)"):
        _cfg(trainer={"model": {"path": "other"}})
    with pytest.raises(ConfigError, match=r"'inference': sets host \(from \[deployment\] host\)"):
        _cfg(inference={"host": "0.0.0.0"})


def test_unknown_keys_name_the_section_and_nearest_key():
    with pytest.raises(
        ConfigError, match=r"unknown key 'orchestrator.batch_sise' \(did you mean 'batch_size'\?\)"
    ):
        _cfg(orchestrator={"batch_sise": 8}).resolve()
    with pytest.raises(ConfigError, match=r"unknown key 'max_step' \(did you mean 'max_steps'\?\)"):
        load_config(RLConfig, {"model": "m", "max_step": 3})
    with pytest.raises(
        ConfigError, match=r"orchestrator: batch_size \(10\) must be a multiple of group_size"
    ):
        _cfg(orchestrator={"batch_size": 10, "group_size": 4}).resolve()


def test_dry_run_writes_configs_and_prints_commands(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(
        [
            "rl",
            "--model",
            "m",
            "--run-dir",
            str(run_dir),
            "--deployment.trainer_nproc",
            "2",
            "--orchestrator.batch_size",
            "8",
            "--orchestrator.group_size",
            "4",
            "--dry-run",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "torch.distributed.run --standalone --nproc-per-node=2 -m asyncrl trainer" in out
    assert "asyncrl inference @" in out and "asyncrl orchestrator @" in out
    orch = tomllib.loads((run_dir / "configs" / "orchestrator.toml").read_text())
    assert orch["batch_size"] == 8 and orch["servers"] == ["http://127.0.0.1:8000"]
    assert not (run_dir / "logs").exists()  # nothing was started


def test_bad_config_exits_2_with_message(capsys):
    assert (
        main(["rl", "--model", "m", "--orchestrator.group-size", "3", "--orchestrator.batch-size", "8"]) == 2
    )
    assert "must be a multiple of group_size" in capsys.readouterr().err


def test_help_lists_keys(capsys):
    assert main(["rl", "--help"]) == 0
    out = capsys.readouterr().out
    assert "max_async_steps" in out and "[trainer]" in out and "--dry-run" in out


def test_the_written_rl_toml_reads_back_to_the_same_processes(tmp_path):
    cfg = _cfg(
        run_dir=str(tmp_path / "run"),
        inference={"backend": "vllm", "max_num_seqs": 8},
        trainer={"loss": {"variant": "tis", "tis_cap": 1.5}},
    )
    files = write_configs(cfg, cfg.resolve())
    written = tomllib.loads(files["rl"].read_text())
    assert written["inference"] == {"backend": "vllm", "max_num_seqs": 8}  # what the run set, no more
    assert written["trainer"] == {"loss": {"variant": "tis", "tis_cap": 1.5}}
    assert load_config(RLConfig, ["@", str(files["rl"])]).resolve() == cfg.resolve()


def test_a_finished_run_keeps_only_the_newest_versions_and_the_final_keep_set(tmp_path):
    """The trainer prunes as it publishes; a best version the keep-set held then but not at the end
    is pruned when the run finishes."""
    from asyncrl.launcher.rl import _prune_finished
    from asyncrl.transport.weights import stable_steps, stage_weights, write_keep_set

    run_dir = tmp_path / "run"
    write_keep_set(run_dir, {2: "best so far"})
    for step in (1, 2, 3, 4):
        with stage_weights(run_dir, step, keep_last=1) as tmp:
            (tmp / "model.safetensors").write_bytes(b"w")
    assert stable_steps(run_dir) == [2, 4]
    write_keep_set(run_dir, {4: "best"})  # the last eval found v4 better
    _prune_finished(_cfg(run_dir=str(run_dir), trainer={"publish": {"keep_last": 1}}).resolve())
    assert stable_steps(run_dir) == [4]


def _dry_run(run_dir, *extra: str) -> None:
    assert main(["rl", "--model", "m", "--run-dir", str(run_dir), "--dry-run", *extra]) == 0


@pytest.mark.parametrize(
    ("cores", "servers", "nproc", "share"),
    [(2, 1, 1, 1), (16, 2, 2, 4), (16, 1, 1, 8), (3, 2, 2, 1)],
)
def test_without_omp_num_threads_the_cores_are_split_among_the_computing_processes(
    tmp_path, capsys, monkeypatch, cores, servers, nproc, share
):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    _dry_run(
        tmp_path / "run",
        "--deployment.num_inference_servers",
        str(servers),
        "--deployment.trainer_nproc",
        str(nproc),
    )
    out = capsys.readouterr().out
    assert f"{cores} core(s) for {servers + nproc} computing process(es)" in out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if ln.startswith("  ")}
    for i in range(servers):
        assert f"OMP_NUM_THREADS={share} " in lines[f"inference-{i}"]
    assert f"OMP_NUM_THREADS={share} " in lines["trainer"]
    assert "OMP_NUM_THREADS=1 " in lines["orchestrator"]


def test_a_set_omp_num_threads_is_left_to_every_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _dry_run(tmp_path / "run")
    out = capsys.readouterr().out
    assert "OMP_NUM_THREADS" not in out  # inherited as set, not rewritten per child
