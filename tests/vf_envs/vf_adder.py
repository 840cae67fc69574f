"""Multi-turn with a tool: add two numbers using the `add` tool, then answer."""

import verifiers.v1 as vf


class AdderToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class AdderData(vf.TaskData):
    a: int
    b: int


class AdderTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class AdderTask(vf.Task[AdderData, vf.State, AdderTaskConfig]):
    @classmethod
    def toolsets(cls, config: AdderTaskConfig) -> list[vf.Toolset]:
        return [AdderToolset(config.tools)]

    @vf.reward(weight=0.75)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.split()[-1:] == [str(self.data.a + self.data.b)])

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.name == "calc_add" for m in trace.tool_messages))

    @vf.metric
    async def num_tool_results(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class AdderConfig(vf.TasksetConfig):
    num_tasks: int = 24
    fail_scoring: bool = False
    """Make every reward raise (tests that a raising environment fails its episode only)."""
    task: AdderTaskConfig = AdderTaskConfig()


class AdderTaskset(vf.Taskset[AdderTask, AdderConfig]):
    def load(self) -> list[AdderTask]:
        tasks = [
            AdderTask(
                AdderData(prompt=f"What is {i} + {2 * i + 1}? Use the tool.", a=i, b=2 * i + 1),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]
        if self.config.fail_scoring:
            tasks = [t.with_data(a=None) for t in tasks]  # a + b raises TypeError at scoring
        return tasks


__all__ = ["AdderTaskset"]
