"""Helpers of the engine tests: run to completion, teacher-forced logprobs, step-by-step greedy, and
two engines held to each other on the same requests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.inference import Engine, RequestOutput, SamplingOptions, cpu_decode, cpu_matmul
from asyncrl.model import Transformer, cpu_norm


def forget_kernel_loads() -> None:
    """Clear the process's cached loads of the engine's CPU kernels (decode attention, matmuls,
    RMSNorm), so that the next use loads each anew. For tests that load them under a broken CC: an
    engine made there caches failed loads of every kernel, and the tests after them in the same
    process would run without the kernels."""
    for load in (cpu_decode.load, cpu_matmul.load, cpu_norm.load):
        load.cache_clear()


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    final: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.tokens += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.versions += out.new_versions
        if out.finished:
            self.final = out


def drain(
    engine: Engine, results: dict[str, Result] | None = None, max_steps: int = 10_000
) -> dict[str, Result]:
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            results.setdefault(out.request_id, Result()).add(out)
    raise AssertionError("engine did not finish")


def teacher_logprobs(
    model: Transformer, prompt: list[int], tokens: list[int], temperature: float, **kw
) -> torch.Tensor:
    """Teacher-forced logprobs of `tokens` after `prompt` under softmax(logits / temperature)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]), **kw).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def greedy_reference(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the plain model, recomputing the whole sequence at each step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def serve_greedy(engine: Engine, prompts: list[list[int]]) -> dict[str, Result]:
    """Greedy answers of 4 to 19 tokens (by position), EOS ignored, to `prompts` as requests r0,
    r1, ... submitted together, run to completion."""
    for i, p in enumerate(prompts):
        engine.add_request(
            f"r{i}", p, SamplingOptions(temperature=0.0, max_tokens=4 + 5 * (i % 4), ignore_eos=True)
        )
    return drain(engine)


def assert_same_answers(got: dict[str, Result], want: dict[str, Result], tol: float) -> None:
    """The same tokens in every answer, and logprobs within `tol` of each other."""
    for rid in want:
        assert got[rid].tokens == want[rid].tokens, rid
        assert (torch.tensor(got[rid].logprobs) - torch.tensor(want[rid].logprobs)).abs().max() < tol, rid


def worst_teacher_error(model: Transformer, prompts: list[list[int]], answers: dict[str, Result]) -> float:
    """The largest |logprob - the model's teacher-forced logprob| over `serve_greedy`'s answers."""
    errors = []
    for i, p in enumerate(prompts):
        answer = answers[f"r{i}"]
        errors.append(
            (teacher_logprobs(model, p, answer.tokens, 1.0) - torch.tensor(answer.logprobs)).abs().max()
        )
    return float(max(errors))
