"""`calculator`: arithmetic questions; the model may call the `calc` tool, then answers with the number.

A multi-turn episode with a tool call: user question -> assistant `<tool_call>` -> tool result ->
assistant answer. Reward `correct` = the last number of the final answer equals the true value.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable

from asyncrl.envs.base import Environment, EpisodeState, Reward, Rubric, Split, Task, draw_in_split, task_rng
from asyncrl.envs.builtin.scoring import last_number
from asyncrl.envs.tools import Tool, ToolError

__all__ = ["CalculatorEnv", "calc", "safe_eval"]

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_EXPONENT = 64
_MAX_LEN = 200


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (max {_MAX_EXPONENT})")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
    raise ToolError(f"unsupported syntax {type(node).__name__}: use numbers, + - * / // % ** and parentheses")


def safe_eval(expression: str) -> float:
    """Evaluate arithmetic without `eval`: only number literals and arithmetic operators are allowed."""
    if len(expression) > _MAX_LEN:
        raise ToolError(f"expression longer than {_MAX_LEN} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot parse {expression!r}: {e.msg}") from None
    return _eval_node(tree.body)


def _format(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. "3 * (4 + 5)"."""
    return _format(safe_eval(expression))


def _correct(state: EpisodeState) -> float:
    value = last_number(state.final_text)
    return float(
        value is not None and "<tool_call>" not in state.final_text and abs(value - state.task.answer) < 1e-6
    )


def _used_calc(state: EpisodeState) -> float:
    return float(any(m["role"] == "tool" and m.get("name") == "calc" for m in state.messages))


class CalculatorEnv(Environment):
    name = "calculator"
    rubric = Rubric(
        rewards=(Reward(name="correct", fn=_correct), Reward(name="used_calc", fn=_used_calc, weight=0.0))
    )
    max_turns = 4

    def __init__(self, *, seed: int = 0, max_operand: int = 99, num_operands: int = 3) -> None:
        if max_operand < 2 or not 2 <= num_operands <= 6:
            raise ValueError(
                f"calculator: need max_operand >= 2 and 2 <= num_operands <= 6, got {max_operand}, "
                f"{num_operands}"
            )
        super().__init__(seed=seed)
        self.max_operand, self.num_operands = max_operand, num_operands

    def task(self, split: Split, index: int) -> Task:
        rng = task_rng(self.seed, self.name, split, index)

        def draw() -> str:
            nums = [rng.randint(2, self.max_operand) for _ in range(self.num_operands)]
            ops = [rng.choice("+-*") for _ in range(self.num_operands - 1)]
            expr = str(nums[0]) + "".join(f" {op} {n}" for op, n in zip(ops, nums[1:]))
            if rng.random() < 0.5:
                expr = f"({expr.rsplit(' ', 2)[0]}) {expr.rsplit(' ', 2)[1]} {nums[-1]}"
            return expr

        expr = draw_in_split(draw, lambda e: f"{self.name}/{e}", split, env=self.name)
        question = f"What is {expr}? You may use the calc tool. Answer with just the number."
        return Task(
            id=f"{self.name}/{split}/{index}",
            prompt=[{"role": "user", "content": question}],
            answer=safe_eval(expr),
            info={"expression": expr},
        )

    def tools(self, state: EpisodeState) -> list[Tool]:
        return [Tool.from_function(calc)]

    def reference(self, task: Task) -> list[dict]:
        call = json.dumps({"name": "calc", "arguments": {"expression": task.info["expression"]}})
        answer = _format(task.answer)
        return [
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "name": "calc", "content": answer},
            {"role": "assistant", "content": answer},
        ]
