"""The vLLM backend's launcher side: config mapping, command, compatibility check, dry-run, Slurm."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

import asyncrl
from asyncrl.config import ConfigError, InferenceConfig, load_config
from asyncrl.config.rl import RLConfig
from asyncrl.launcher.cli import main
from asyncrl.launcher.slurm import SlurmRLConfig, render_sbatch
from asyncrl.launcher.vllm import (
    PACKAGE_DIR_ENV,
    WEIGHT_TRANSFER_BACKEND,
    WORKER_EXTENSION_CLS,
    WORKER_EXTENSION_DIR,
    VLLMProbe,
    build_vllm_command,
    check_vllm,
    resolve_vllm_python,
)

GIB = 1 << 30
# tiny-moe's attention: 4 layers x (K + V) x 2 KV heads x 32 dims
TINY = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_size": 128,
    "max_position_embeddings": 4096,
}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    return d


def _inference(model_dir, **kw) -> InferenceConfig:
    return InferenceConfig(model=str(model_dir), backend="vllm", **kw)


def _probe(command, **kw) -> VLLMProbe:
    flags = {a for a in command.argv if a.startswith("--")}
    base = {
        "version": "0.32.0",
        "device_type": "cpu",
        "flags": frozenset(flags),
        "architectures": frozenset({"Qwen3MoeForCausalLM"}),
    }
    return VLLMProbe(**(base | kw))


def test_command_maps_our_keys_to_vllm_flags(model_dir):
    cfg = _inference(
        model_dir,
        dtype="bfloat16",
        max_num_seqs=7,
        port=8123,
        api_key="sekret",
        enable_prefix_caching=False,
        vllm={
            "tensor_parallel_size": 2,
            "enable_expert_parallel": True,
            "quantization": "fp8",
            "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            "cpu_kv_cache_space_gb": 2,
            "extra_args": ["--enforce-eager"],
        },
    )
    cmd = build_vllm_command(cfg, python="/venv/bin/python")
    a = cmd.argv
    assert a[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag):
        return a[a.index(flag) + 1]

    assert value("--model") == str(model_dir) and value("--port") == "8123" and value("--dtype") == "bfloat16"
    assert value("--max-num-seqs") == "7" and value("--tensor-parallel-size") == "2"
    assert value("--quantization") == "fp8"
    assert json.loads(value("--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
    }
    assert value("--logprobs-mode") == "processed_logprobs"
    assert {"--enable-expert-parallel", "--no-enable-prefix-caching", "--enable-scale-out"} <= set(a)
    assert a[-1] == "--enforce-eager"
    assert "--block-size" not in a  # left to vLLM unless set: its CPU attention needs multiples of 32
    # the key travels in the environment, never on the command line or in the printed command
    assert "sekret" not in " ".join(a) and cmd.env["VLLM_API_KEY"] == "sekret"
    assert "sekret" not in cmd.shell() and "VLLM_SERVER_DEV_MODE=1" in cmd.shell()
    assert cmd.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # asyncrl's worker extension: its folder on vLLM's path, its class named on the command line
    assert value("--worker-extension-cls") == WORKER_EXTENSION_CLS
    assert cmd.env["PYTHONPATH"] == str(WORKER_EXTENSION_DIR)
    assert (WORKER_EXTENSION_DIR / "asyncrl_vllm_ext.py").is_file()
    mine = build_vllm_command(_inference(model_dir, vllm={"env": {"PYTHONPATH": "/mine"}}), python="py")
    assert mine.env["PYTHONPATH"] == f"/mine:{WORKER_EXTENSION_DIR}"  # the user's first, ours kept


def test_worker_extension_imports_without_vllm_and_leaves_other_models_alone():
    # It runs in vLLM's interpreter, so it may import torch and vLLM only: here (no vLLM), a model
    # without vLLM's CPU MoE experts is left as it is.
    sys.path.insert(0, str(WORKER_EXTENSION_DIR))
    try:
        import asyncrl_vllm_ext
    finally:
        sys.path.remove(str(WORKER_EXTENSION_DIR))
    source = (WORKER_EXTENSION_DIR / "asyncrl_vllm_ext.py").read_text()
    assert "import asyncrl" not in source.replace("import asyncrl_vllm_ext", "")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = model[0].weight.detach().clone()
    assert asyncrl_vllm_ext.repack_cpu_moe_experts(model) == 0
    assert torch.equal(model[0].weight, before)


def _model(tmp_path, name: str, config: dict):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_cpu_kv_cache_default_fits_max_num_seqs_full_sequences(tmp_path):
    tiny = _model(tmp_path, "tiny", TINY)
    cfg = _inference(tiny, dtype="bfloat16", max_num_seqs=128, max_model_len=512)
    cmd = build_vllm_command(cfg, python="py", available_bytes=20 * GIB)
    # 4 x 2 x 2 x 32 x 2 B = 1 KiB/token; 128 x 512 tokens = 64 MiB, rounded up to whole GiB
    assert cmd.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert (cmd.cpu_kv.bytes_per_token, cmd.cpu_kv.num_tokens, cmd.cpu_kv.capped) == (1024, 65536, False)
    # said at start on a CPU build; a GPU build ignores the variable
    notice = check_vllm(cfg, cmd, _probe(cmd))
    assert notice == [cmd.cpu_kv.describe()] and "KV cache 1 GiB" in notice[0]
    assert "1024 B/token x 65536 tokens" in notice[0]
    assert check_vllm(cfg, cmd, _probe(cmd, device_type="cuda")) == []
    # without max_model_len the context is the model's (4096), and fp32 doubles the bytes:
    # 2 KiB x 128 x 4096 = 1 GiB exactly
    wide = build_vllm_command(_inference(tiny, max_num_seqs=128), python="py", available_bytes=20 * GIB)
    assert (wide.cpu_kv.bytes_per_token, wide.env["VLLM_CPU_KVCACHE_SPACE"]) == (2048, "1")


def test_cpu_kv_cache_default_is_capped_by_the_memory_available(tmp_path):
    # a ~0.5B dense model: 24 layers x 2 x 2 KV heads x 64 dims x 2 B = 12 KiB/token
    half_b = _model(tmp_path, "half-b", TINY | {"num_hidden_layers": 24, "head_dim": 64})
    cfg = _inference(half_b, dtype="bfloat16", max_num_seqs=64, max_model_len=8192)
    roomy = build_vllm_command(cfg, python="py", available_bytes=64 * GIB)
    assert roomy.env["VLLM_CPU_KVCACHE_SPACE"] == "6" and not roomy.cpu_kv.capped  # 6 GiB wanted
    small = build_vllm_command(cfg, python="py", available_bytes=20 * GIB)  # a 24 GB machine, busy
    assert small.env["VLLM_CPU_KVCACHE_SPACE"] == "5" and small.cpu_kv.capped  # a quarter of 20 GiB
    assert "capped at 25% of the 20.0 GiB available; 436906 tokens of the 524288 wanted" in (
        small.cpu_kv.describe()
    )
    assert build_vllm_command(cfg, python="py", available_bytes=2 * GIB).env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_cpu_kv_cache_default_of_a_latent_attention_model(tmp_path):
    # MLA caches one latent + rotary key per layer, DSA its indexer key too: 2 x (512 + 64 + 128) x 2 B
    mla = _model(
        tmp_path,
        "mla",
        TINY | {"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128},
    )
    cfg = _inference(mla, dtype="bfloat16", max_num_seqs=4, max_model_len=1024)
    cmd = build_vllm_command(cfg, python="py", available_bytes=GIB)
    assert cmd.cpu_kv.bytes_per_token == 2 * (512 + 64 + 128) * 2


def test_the_user_s_cpu_kv_cache_size_wins_over_the_default(tmp_path):
    tiny = _model(tmp_path, "tiny", TINY)
    mine = build_vllm_command(_inference(tiny, vllm={"cpu_kv_cache_space_gb": 3}), python="py")
    assert mine.env["VLLM_CPU_KVCACHE_SPACE"] == "3" and mine.cpu_kv is None
    by_env = build_vllm_command(_inference(tiny, vllm={"env": {"VLLM_CPU_KVCACHE_SPACE": "4"}}), python="py")
    assert by_env.env["VLLM_CPU_KVCACHE_SPACE"] == "4" and by_env.cpu_kv is None
    assert check_vllm(_inference(tiny), by_env, _probe(by_env)) == []


def test_unknown_vllm_key_is_an_error_naming_it(model_dir):
    with pytest.raises(ConfigError, match="tensor_paralel_size"):
        load_config(InferenceConfig, {"model": "m", "backend": "vllm", "vllm": {"tensor_paralel_size": 2}})


def test_compatibility_check_names_the_problem(model_dir):
    cfg = _inference(model_dir)
    cmd = build_vllm_command(cfg, python="py")
    assert check_vllm(cfg, cmd, _probe(cmd)) == []
    with pytest.raises(ConfigError, match=r"vLLM 0.31.2 is too old: asyncrl needs >= 0.32"):
        check_vllm(cfg, cmd, _probe(cmd, version="0.31.2"))
    with pytest.raises(ConfigError, match=r"does not accept \['--enable-scale-out'\]"):
        check_vllm(cfg, cmd, _probe(cmd, flags=frozenset(a for a in cmd.argv if a != "--enable-scale-out")))
    with pytest.raises(ConfigError, match="architectures \\['Qwen3MoeForCausalLM'\\] unsupported"):
        check_vllm(cfg, cmd, _probe(cmd, architectures=frozenset({"LlamaForCausalLM"})))
    routed = _inference(model_dir, vllm={"enable_return_routed_experts": True})
    rcmd = build_vllm_command(routed, python="py")
    with pytest.raises(ConfigError, match="needs a GPU build"):
        check_vllm(routed, rcmd, _probe(rcmd))
    assert check_vllm(routed, rcmd, _probe(rcmd, device_type="cuda")) == []
    noisy = _inference(model_dir, kv_cache_tokens=4096, vllm={"cpu_kv_cache_space_gb": 1})
    ncmd = build_vllm_command(noisy, python="py")
    assert check_vllm(noisy, ncmd, _probe(ncmd)) == [
        "[inference] kv_cache_tokens has no effect with backend = 'vllm'"
    ]


def test_vllm_python_default(tmp_path, model_dir):
    cfg = _inference(model_dir)
    assert resolve_vllm_python(cfg, root=tmp_path) == sys.executable
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    assert resolve_vllm_python(cfg, root=tmp_path) == str(venv / "python")
    assert (
        resolve_vllm_python(_inference(model_dir, vllm={"python": "/opt/v/bin/python"}))
        == "/opt/v/bin/python"
    )


def _rl(model_dir, **kw) -> RLConfig:
    base = {"model": str(model_dir), "run_dir": "r", "inference": {"backend": "vllm"}}
    return load_config(RLConfig, base | kw)


def test_distributed_weights_reach_every_vllm_worker_through_its_engine(model_dir):
    cfg = _rl(model_dir, weights={"transport": "distributed", "timeout_s": 30})
    cfg = cfg.with_weights_endpoint("127.0.0.1", 29711)
    resolved = cfg.resolve()  # vLLM takes the distributed transport
    assert resolved.orchestrator.weights_transport == "distributed"
    cmd = build_vllm_command(resolved.inference[0], python="py")
    a = cmd.argv
    assert json.loads(a[a.index("--weight-transfer-config") + 1]) == {"backend": WEIGHT_TRANSFER_BACKEND}
    assert cmd.env["ASYNCRL_WEIGHTS_ENDPOINT"] == "127.0.0.1:29711"
    assert (
        cmd.env["ASYNCRL_WEIGHTS_SERVER"] == "server0" and float(cmd.env["ASYNCRL_WEIGHTS_TIMEOUT_S"]) == 30
    )
    # the engine imports this very package (and nothing else of this environment) in vLLM's interpreter
    package = cmd.env[PACKAGE_DIR_ENV]
    assert os.path.samefile(os.path.join(package, "__init__.py"), asyncrl.__file__)
    # the extension registers the engine under the name the command asks for (it runs in vLLM's
    # interpreter; here, without vLLM, it registers nothing)
    sys.path.insert(0, str(WORKER_EXTENSION_DIR))
    try:
        import asyncrl_vllm_ext
    finally:
        sys.path.remove(str(WORKER_EXTENSION_DIR))
    assert asyncrl_vllm_ext.ENGINE_NAME == WEIGHT_TRANSFER_BACKEND and not asyncrl_vllm_ext.register_engine()
    files = build_vllm_command(_rl(model_dir).resolve().inference[0], python="py")
    assert "--weight-transfer-config" not in files.argv and "ASYNCRL_WEIGHTS_ENDPOINT" not in files.env
    replicas = resolved.inference[0].model_copy(
        update={"vllm": resolved.inference[0].vllm.model_copy(update={"data_parallel_size": 2})}
    )
    rcmd = build_vllm_command(replicas, python="py")
    with pytest.raises(ConfigError, match="one vLLM replica per server"):
        check_vllm(replicas, rcmd, _probe(rcmd))


def test_resolve_tells_the_orchestrator_the_backend_and_turns_replay_off(model_dir):
    r = _rl(model_dir).resolve()
    assert r.orchestrator.inference_backend == "vllm"
    assert r.orchestrator.return_routed_experts is False
    with pytest.raises(ConfigError, match="enable_return_routed_experts"):
        _rl(model_dir, orchestrator={"return_routed_experts": True}).resolve()
    gpu = _rl(
        model_dir, inference={"backend": "vllm", "vllm": {"enable_return_routed_experts": True}}
    ).resolve()
    assert gpu.orchestrator.return_routed_experts is True
    with pytest.raises(ConfigError, match="inference_backend"):
        _rl(model_dir, orchestrator={"inference_backend": "vllm"}).resolve()
    assert load_config(RLConfig, {"model": "m"}).resolve().orchestrator.inference_backend == "embedded"


def test_dry_run_prints_the_vllm_command_and_says_replay_is_off(model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(
        [
            "rl",
            "--model",
            str(model_dir),
            "--run-dir",
            str(run),
            "--inference.backend",
            "vllm",
            "--inference.vllm.python",
            "/v/bin/python",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.strip().startswith("inference-0:"))
    assert "VLLM_SERVER_DEV_MODE=1 /v/bin/python -m vllm.entrypoints.openai.api_server" in line
    assert f"--model {model_dir}" in line and "--port 8000" in line
    assert "router replay OFF" in out


def test_the_printed_vllm_command_finds_the_worker_extension(model_dir, tmp_path, capsys):
    code = main(
        [
            "rl",
            "--model",
            str(model_dir),
            "--run-dir",
            str(tmp_path / "run"),
            "--inference.backend",
            "vllm",
            "--inference.vllm.python",
            sys.executable,
            "--dry-run",
        ]
    )
    assert code == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("inference-0:"))
    words = shlex.split(line.split(":", 1)[1])
    assigned = list(itertools.takewhile(lambda w: "=" in w and not w.startswith("-"), words))
    argv = words[len(assigned) :]
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION_CLS
    # The server's interpreter, started with exactly the printed environment, finds the extension's
    # module (located, not imported: it imports vLLM).
    env = {k: v for k, v in (w.split("=", 1) for w in assigned)} | {"PATH": os.environ["PATH"]}
    module = WORKER_EXTENSION_CLS.split(".")[0]
    find = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    assert subprocess.run([argv[0], "-c", find], env=env, check=False).returncode == 0


def test_slurm_renders_vllm_servers(model_dir, tmp_path):
    cfg = load_config(
        SlurmRLConfig,
        {
            "model": str(model_dir),
            "run_dir": str(tmp_path),
            "api_key": "k",
            "deployment": {"num_inference_servers": 2},
            "inference": {
                "backend": "vllm",
                "vllm": {"data_parallel_size": 8, "enable_expert_parallel": True},
            },
            "slurm": {"inference_nodes": 2, "trainer_nodes": 1},
        },
    )
    script = render_sbatch(cfg, tmp_path)
    server = next(x for x in script.splitlines() if "vllm.entrypoints.openai.api_server" in x)
    assert " .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server" in server
    assert server.startswith("launch 0 0:8 ") and " env " in server  # node 0, its 8 GPUs
    assert "--host 0.0.0.0 --port 8000" in server and "--seed 0" in server
    assert "--data-parallel-size 8 --enable-expert-parallel" in server
    assert "VLLM_SERVER_DEV_MODE=1" in script and "export VLLM_API_KEY=" in script
    assert f"PYTHONPATH={WORKER_EXTENSION_DIR}" in script and WORKER_EXTENSION_CLS in server
    assert "asyncrl inference @" not in script


def test_slurm_vllm_servers_find_the_weights_store_on_the_trainer_node(model_dir, tmp_path):
    cfg = load_config(
        SlurmRLConfig,
        {
            "model": str(model_dir),
            "run_dir": str(tmp_path),
            "api_key": "k",
            "deployment": {"num_inference_servers": 2},
            "inference": {"backend": "vllm"},
            "weights": {"transport": "distributed"},
            "slurm": {"inference_nodes": 1, "trainer_nodes": 1, "servers_per_inference_node": 2},
        },
    ).with_job_weights_endpoint()
    servers = [x for x in render_sbatch(cfg, tmp_path).splitlines() if "vllm.entrypoints" in x]
    assert len(servers) == 2 and all("--weight-transfer-config" in x for x in servers)
    words = [w for w in shlex.split(servers[1], posix=False) if w.startswith("ASYNCRL_WEIGHTS_")]
    # the job's shell expands the trainer node's name; each server has its own name on the store
    shown = subprocess.run(
        ["bash", "-c", f"TRAINER_MASTER=node7; echo {' '.join(words)}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert {"ASYNCRL_WEIGHTS_ENDPOINT=node7:29501", "ASYNCRL_WEIGHTS_SERVER=server1"} <= set(shown)


def test_asyncrl_inference_refuses_the_vllm_backend(model_dir, capsys):
    assert main(["inference", "--model", str(model_dir), "--backend", "vllm"]) == 2
    assert "served by vLLM itself" in capsys.readouterr().err


def test_without_omp_num_threads_a_vllm_server_counts_but_keeps_its_own_threads(
    model_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    argv = ["rl", "--model", str(model_dir), "--run-dir", str(tmp_path / "run"), "--dry-run"]
    assert main([*argv, "--inference.backend", "vllm", "--inference.vllm.python", "/v/bin/python"]) == 0
    out = capsys.readouterr().out
    assert "8 core(s) for 2 computing process(es)" in out
    lines = {x.split(":")[0].strip(): x for x in out.splitlines() if x.startswith("  ")}
    assert "OMP_NUM_THREADS" not in lines["inference-0"]  # vLLM binds its own threads
    assert "OMP_NUM_THREADS=4 " in lines["trainer"] and "OMP_NUM_THREADS=1 " in lines["orchestrator"]
