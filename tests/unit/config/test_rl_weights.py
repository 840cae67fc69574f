"""`[weights]`: the transport of policy versions, files by default, validated as it is read."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config, parse_cli_overrides
from asyncrl.config.rl import RLConfig
from asyncrl.config.weights import DistributedWeightsConfig, FilesystemWeightsConfig


def _rl(argv: list[str]) -> RLConfig:
    return load_config(RLConfig, ["--model", "m", "--run_dir", "r", *argv])


def test_files_by_default_and_resolve_is_unchanged():
    """The default run, and one that names the default, resolve as before [weights] existed."""
    cfg = _rl([])
    assert cfg.weights == FilesystemWeightsConfig()
    assert cfg.resolve().trainer.publish.dtype == "float32"


def test_command_line_chooses_distributed_with_its_bucket_size():
    cfg = _rl(["--weights.transport", "distributed", "--weights.bucket_bytes", str(8 << 20)])
    assert cfg.weights == DistributedWeightsConfig(bucket_bytes=8 << 20, delta=True, timeout_s=120.0)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--weights.transport", "nccl"], r"'weights.transport': 'nccl' is not one of"),
        (["--weights.transport", "distributed", "--weights.bucket_bytes", "1000"], r"bucket_bytes"),
        (["--weights.transport", "distributed", "--weights.bucket_bytes", str(1 << 32)], r"bucket_bytes"),
        (["--weights.transport", "distributed", "--weights.timeout_s", "0"], r"timeout_s"),
        (
            ["--weights.bucket_bytes", str(8 << 20)],
            r"'weights.bucket_bytes': it belongs to transport = 'distributed'",
        ),
        (["--weights.delta", "false"], r"this table's transport is 'filesystem'"),
    ],
)
def test_bad_settings_fail_as_the_config_is_read(argv, match):
    with pytest.raises(ConfigError, match=match):
        _rl(argv)


def test_distributed_reaches_every_process_with_the_endpoint_the_launcher_picked():
    cfg = _rl(["--weights.transport", "distributed", "--deployment.num_inference_servers", "2"])
    resolved = cfg.with_weights_endpoint("127.0.0.1", 29711).resolve()
    assert resolved.trainer.weights.endpoint == "127.0.0.1:29711"
    assert [(i.weights, i.weights_server) for i in resolved.inference] == [
        (resolved.trainer.weights, "server0"),
        (resolved.trainer.weights, "server1"),
    ]
    assert resolved.orchestrator.weights_transport == "distributed"
    mine = _rl(["--weights.transport", "distributed", "--weights.endpoint", "10.0.0.1:29700"])
    assert mine.with_weights_endpoint("127.0.0.1", 1).weights.endpoint == "10.0.0.1:29700"  # the user's stays
    assert _rl([]).with_weights_endpoint("127.0.0.1", 1).weights == FilesystemWeightsConfig()


def test_distributed_without_an_endpoint_is_refused():
    cfg = _rl(["--weights.transport", "distributed"])
    with pytest.raises(ConfigError, match=r"needs weights.endpoint"):
        cfg.resolve()
    with pytest.raises(ConfigError, match=r"must be host:port"):
        _rl(["--weights.transport", "distributed", "--weights.endpoint", "nohost"])


def test_overrides_parse_into_the_weights_table():
    assert parse_cli_overrides(["--weights.transport", "distributed"]) == {
        "weights": {"transport": "distributed"}
    }
