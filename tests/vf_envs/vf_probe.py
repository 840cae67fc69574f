"""Tools that answer or hang, and a metric that keeps each trace its task scores: what a verifiers reward
sees."""

import asyncio

import verifiers.v1 as vf

SCORED: list[vf.Trace] = []
"""Every trace `ProbeTask.score` saw, in order (tests clear it first)."""


class ProbeToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "probe"

    @vf.tool
    def echo(self, text: str) -> str:
        """Return the text."""
        return text

    @vf.tool
    async def wait(self) -> str:
        """Never return (an episode deadline cuts it)."""
        await asyncio.Event().wait()
        return "unreachable"


class ProbeTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ProbeTask(vf.Task[vf.TaskData, vf.State, ProbeTaskConfig]):
    @classmethod
    def toolsets(cls, config: ProbeTaskConfig) -> list[vf.Toolset]:
        return [ProbeToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def finished(self, trace: vf.Trace) -> float:
        return float(trace.stop_condition == "agent_completed")

    @vf.metric
    async def seen(self, trace: vf.Trace) -> float:
        SCORED.append(trace)
        return float(len(SCORED))


class ProbeConfig(vf.TasksetConfig):
    num_tasks: int = 8
    task: ProbeTaskConfig = ProbeTaskConfig()


class ProbeTaskset(vf.Taskset[ProbeTask, ProbeConfig]):
    def load(self) -> list[ProbeTask]:
        return [
            ProbeTask(vf.TaskData(prompt=f"Probe {i}: call the tools."), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["ProbeTaskset"]
