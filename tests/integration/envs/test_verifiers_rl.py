"""A short `asyncrl rl` on verifiers environments asyncrl has never seen, written here as verifiers' docs
show.

Two modules are written to a temporary directory and put on the children's PYTHONPATH: a
single-turn taskset and a multi-turn one with a `vf.Toolset` tool. The tiny random model never
writes a correct answer or a tool call, so each also has a graded reward a random reply varies on
(otherwise every group has zero advantage and no batch fills). The tool path of the exact loop is
covered with scripted replies in tests/unit/envs/test_verifiers_env.py and test_verifiers_eval_env.py.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tomli_w

from asyncrl.tools.init_model import init_model
from asyncrl.transport.rollouts import read_batch
from helpers import child_env, free_port

pytest.importorskip("verifiers.v1", reason="verifiers is an optional extra: pip install -e '.[verifiers]'")

STEPS = 2

SINGLE_TURN = """
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    word: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def letters(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return sum(c.isalpha() for c in reply) / max(len(reply), 1)

    @vf.metric
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.word)


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 8


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self) -> list[EchoTask]:
        words = ["red", "green", "blue", "cyan", "pink", "gold", "gray", "teal"][: self.config.num_tasks]
        return [EchoTask(EchoData(prompt=f"Say the word {w}", word=w)) for w in words]


__all__ = ["EchoTaskset"]
"""

MULTI_TURN = '''
import verifiers.v1 as vf


class MulTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "math"

    @vf.tool
    def mul(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)


class MulData(vf.TaskData):
    a: int
    b: int


class MulTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class MulTask(vf.Task[MulData, vf.State, MulTaskConfig]):
    @classmethod
    def toolsets(cls, config: MulTaskConfig) -> list[vf.Toolset]:
        return [MulTools(config.tools)]

    @vf.reward(weight=0.6)
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.a * self.data.b) in trace.last_reply)

    @vf.reward(weight=0.2)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)

    @vf.reward(weight=0.2)
    async def digits(self, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return sum(c.isdigit() for c in reply) / max(len(reply), 1)


class MulConfig(vf.TasksetConfig):
    num_tasks: int = 8
    task: MulTaskConfig = MulTaskConfig()


class MulTaskset(vf.Taskset[MulTask, MulConfig]):
    def load(self) -> list[MulTask]:
        return [MulTask(MulData(prompt=f"What is {i} * 7? Use the tool.", a=i, b=7), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["MulTaskset"]
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rl_trains_on_verifiers_environments(tmp_path):
    envs_dir = tmp_path / "user_envs"
    envs_dir.mkdir()
    (envs_dir / "my_echo_env.py").write_text(textwrap.dedent(SINGLE_TURN))
    (envs_dir / "my_mul_env.py").write_text(textwrap.dedent(MULTI_TURN))
    init_model("tiny-moe", tmp_path / "model", seed=0)
    run_dir = tmp_path / "run"
    config = {
        "model": str(tmp_path / "model"),
        "run_dir": str(run_dir),
        "max_steps": STEPS,
        "seq_len": 512,
        "deployment": {"base_port": free_port()},
        "inference": {"max_num_seqs": 32, "device": "cpu"},
        "orchestrator": {
            "batch_size": 8,
            "group_size": 4,
            "sampling": {"temperature": 1.0, "max_tokens": 8},
            "envs": {
                "envs": [
                    {"name": "verifiers:my_echo_env", "args": {"num_tasks": 8}, "max_total_tokens": 512},
                    {
                        "name": "verifiers:my_mul_env",
                        "args": {"num_tasks": 8},
                        "max_turns": 3,
                        "max_total_tokens": 512,
                    },
                ]
            },
        },
        "trainer": {"optim": {"lr": 1e-3}, "peak_flops": 1e11},
    }
    path = tmp_path / "rl.toml"
    path.write_text(tomli_w.dumps(config))
    env = child_env(PYTHONPATH=os.pathsep.join([child_env()["PYTHONPATH"], str(envs_dir)]))
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "rl", "@", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    orch = [r for r in records if r.get("role") == "orchestrator"]
    trainer = [r for r in records if r.get("role") != "orchestrator"]
    assert sorted(r["step"] for r in orch) == list(range(1, STEPS + 1)) and len(trainer) == STEPS
    assert all(r["loss"] == r["loss"] for r in trainer)  # finite losses were trained on
    seen_envs = set()
    for step in range(1, STEPS + 1):
        batch = read_batch(run_dir, step, timeout_s=1.0)
        assert len(batch.samples) >= 8
        for s in batch.samples:
            seen_envs.add(s.env)
            assert s.loss_mask.any() and (s.policy_versions[s.loss_mask] >= 0).all()
            assert (s.policy_versions[~s.loss_mask] == -1).all()
            assert s.routed_experts is not None and len(s.routed_experts) == len(s.token_ids)
            assert 0.0 <= s.reward <= 1.0
        assert len({s.reward for s in batch.samples}) > 1  # the env's graded rewards reached the batch
    assert seen_envs <= {"verifiers:my_echo_env", "verifiers:my_mul_env"} and seen_envs
