"""Tasks from disk (envs/task_data.py) and the `dataset` env: formats, splits, seeded order, errors."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from asyncrl.config import EnvConfig
from asyncrl.envs import EnvConfigError, ScriptedClient, TokenPolicy, build_env, run_episode
from asyncrl.envs.task_data import TaskDataError, TaskTable
from asyncrl.wire import SamplingParams

ROWS = [{"question": f"What is {i} + {i}?", "answer": 2 * i, "level": i % 3} for i in range(40)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _all(table, split):
    return [table.row(split, i) for i in range(table.size(split))]


def test_jsonl_rows_become_tasks_with_a_hashed_disjoint_eval_split(tmp_path):
    data = {"path": str(_jsonl(tmp_path / "qa.jsonl", ROWS)), "prompt_field": "question"}
    table = TaskTable.load(data, seed=0)
    train, evals = _all(table, "train"), _all(table, "eval")
    assert table.size("train") + table.size("eval") == 40 and 0 < table.size("eval") < 15
    assert {r.row["question"] for r in train}.isdisjoint(r.row["question"] for r in evals)
    first = train[0]
    assert first.prompt == [{"role": "user", "content": first.row["question"]}]
    assert first.answer == first.row["answer"] and first.where.startswith("qa.jsonl line ")
    # the split is a property of the row's content: the same under another seed and another order
    other = TaskTable.load(data, seed=5)
    assert sorted(r.row["question"] for r in _all(other, "eval")) == sorted(r.row["question"] for r in evals)
    _jsonl(tmp_path / "rev.jsonl", ROWS[::-1])
    reordered = TaskTable.load(data | {"path": str(tmp_path / "rev.jsonl")}, seed=0)
    assert {r.row["question"] for r in _all(reordered, "eval")} == {r.row["question"] for r in evals}
    none = TaskTable.load(data | {"eval_fraction": 0.0}, seed=0)
    assert none.size("train") == 40 and none.size("eval") == 0
    with pytest.raises(TaskDataError, match="no eval tasks; give data.eval_path"):
        none.row("eval", 0)


def test_order_is_a_seeded_permutation_per_pass(tmp_path):
    data = {
        "path": str(_jsonl(tmp_path / "qa.jsonl", ROWS)),
        "prompt_field": "question",
        "eval_fraction": 0.0,
    }
    table, again, other = (TaskTable.load(data, seed=s) for s in (0, 0, 1))
    passes = [[table.row("train", e * 40 + i).row["question"] for i in range(40)] for e in range(3)]
    assert all(sorted(p) == sorted(r["question"] for r in ROWS) for p in passes)  # each pass: every row once
    assert passes[0] != passes[1] != passes[2]  # reshuffled per pass
    assert passes[0] != [r["question"] for r in ROWS]  # not the file order
    assert [again.row("train", i).row["question"] for i in range(120)] == [q for p in passes for q in p]
    assert [other.row("train", i).row["question"] for i in range(40)] != passes[0]
    plain = TaskTable.load(data | {"shuffle": False}, seed=3)
    assert [plain.row("train", i).row["question"] for i in range(80)] == [r["question"] for r in ROWS] * 2


def test_separate_eval_file_messages_prompts_and_system_prompt(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "hi", "answer": "a"}])
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    evals = _jsonl(
        tmp_path / "eval.jsonl", [{"prompt": chat, "answer": "4"}, {"prompt": "yo", "answer": "b"}]
    )
    table = TaskTable.load({"path": str(train), "eval_path": str(evals), "system_prompt": "SYS"}, seed=0)
    assert table.size("train") == 1 and table.size("eval") == 2
    assert table.row("train", 0).prompt == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "hi"},
    ]
    prompts = [r.prompt for r in _all(table, "eval")]
    assert chat in prompts  # its own system message is kept, not doubled
    assert [{"role": "system", "content": "SYS"}, {"role": "user", "content": "yo"}] in prompts
    no_answers = TaskTable.load({"path": str(train), "answer_field": ""}, seed=0)
    assert no_answers.row("train", 0).answer is None


def test_parquet_file(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet needs pyarrow: pip install -e '.[data]'")
    import pyarrow as pa

    rows = [
        {"q": f"reverse: {w}", "a": w[::-1], "chat": [{"role": "user", "content": w}]}
        for w in ["apple", "river", "stone", "cloud", "maple", "tiger", "piano", "lemon"]
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    table = TaskTable.load(
        {
            "path": str(tmp_path / "t.parquet"),
            "prompt_field": "q",
            "answer_field": "a",
            "eval_fraction": 0.0,
            "shuffle": False,
        },
        seed=0,
    )
    assert [r.answer for r in _all(table, "train")] == [r["a"] for r in rows]
    assert table.row("train", 2).where == "t.parquet row 2"
    messages = TaskTable.load(
        {"path": str(tmp_path / "t.parquet"), "prompt_field": "chat", "answer_field": "a"}
    )
    assert messages.row("train", 0).prompt[0]["role"] == "user"
    with pytest.raises(
        TaskDataError, match=r"t.parquet row 0: no field 'question' \(the row has \['a', 'chat', 'q'\]\)"
    ):
        TaskTable.load({"path": str(tmp_path / "t.parquet"), "prompt_field": "question"})
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TaskDataError, match="not a readable Parquet file"):
        TaskTable.load({"path": str(tmp_path / "bad.parquet")})


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip(
        "datasets", reason="writing save_to_disk directories needs datasets (dev extra)"
    )
    train = datasets.Dataset.from_list(ROWS[:30])
    test = datasets.Dataset.from_list(ROWS[30:])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    train.shuffle(seed=1).select(range(10)).save_to_disk(
        str(tmp_path / "one")
    )  # an indices mapping, flattened
    table = TaskTable.load({"path": str(tmp_path / "dd"), "eval_split": "test", "prompt_field": "question"})
    assert sorted(r.row["question"] for r in _all(table, "train")) == sorted(r["question"] for r in ROWS[:30])
    assert sorted(r.row["question"] for r in _all(table, "eval")) == sorted(r["question"] for r in ROWS[30:])
    assert table.row("eval", 0).where.startswith("dd[test] row ")
    one = TaskTable.load(
        {"path": str(tmp_path / "one"), "prompt_field": "question", "shuffle": False, "eval_fraction": 0.0}
    )
    assert [r.row for r in _all(one, "train")] == train.shuffle(seed=1).select(range(10)).to_list()
    with pytest.raises(TaskDataError, match=r"no split 'validation'; it holds \['train', 'test'\]"):
        TaskTable.load({"path": str(tmp_path / "dd"), "eval_split": "validation", "prompt_field": "question"})
    with pytest.raises(TaskDataError, match="single saved Dataset, not a DatasetDict"):
        TaskTable.load({"path": str(tmp_path / "one"), "split": "train", "prompt_field": "question"})
    (tmp_path / "plain").mkdir()
    with pytest.raises(TaskDataError, match="written by datasets' save_to_disk"):
        TaskTable.load({"path": str(tmp_path / "plain")})


def test_missing_pyarrow_is_named(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    with pytest.raises(TaskDataError, match=r"needs pyarrow: pip install -e \"\.\[data\]\""):
        TaskTable.load({"path": str(tmp_path / "t.parquet")})


@pytest.mark.parametrize(
    ("content", "settings", "message"),
    [
        (
            '{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2\n',
            {},
            r"qa.jsonl line 2: not valid JSON",
        ),
        (
            '{"prompt": "a", "answer": 1}\n\n[1, 2]\n',
            {},
            r"qa.jsonl line 3: a row must be a JSON object, got list",
        ),
        (
            '{"question": "a", "answer": 1}\n',
            {},
            r"qa.jsonl line 1: no field 'prompt' \(the row has \['answer', 'question'\]\); set "
            r"data.prompt_field",
        ),
        ('{"prompt": "a", "solution": 1}\n', {}, r"line 1: no field 'answer' .*set data.answer_field"),
        ('{"prompt": "a", "answer": null}\n', {}, r"line 1: field 'answer' is null"),
        ('{"prompt": 7, "answer": 1}\n', {}, r"line 1: field 'prompt' must be a string or a non-empty list"),
        ('{"prompt": "  ", "answer": 1}\n', {}, r"line 1: field 'prompt' is an empty string"),
        (
            '{"prompt": [{"role": "robot", "content": "x"}], "answer": 1}\n',
            {},
            r"line 1: prompt\[0\] must be a message",
        ),
        ("", {}, r"no train tasks"),
        (
            '{"prompt": "a", "answer": 1}\n',
            {"eval_fraction": 1.5},
            r"data.eval_fraction: Input should be less than 1",
        ),
        (
            '{"prompt": "a", "answer": 1}\n',
            {"prompt_feild": "q"},
            r"data.prompt_feild: Extra inputs are not permitted",
        ),
        (
            '{"prompt": "a", "answer": 1}\n',
            {"eval_fraction": 0.1, "eval_path": "x.jsonl"},
            "cannot be combined",
        ),
        ('{"prompt": "a", "answer": 1}\n', {"split": "train"}, "only a save_to_disk directory has splits"),
    ],
)
def test_bad_data_is_a_clear_error(tmp_path, content, settings, message):
    (tmp_path / "qa.jsonl").write_text(content)
    with pytest.raises(TaskDataError, match=message):
        TaskTable.load({"path": str(tmp_path / "qa.jsonl")} | settings)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(TaskDataError, match=r"task data '.*nope.jsonl' does not exist \(resolved to /"):
        TaskTable.load({"path": str(tmp_path / "nope.jsonl")})
    (tmp_path / "t.csv").write_text("prompt,answer\na,b\n")
    with pytest.raises(TaskDataError, match=r"unknown task data format '.csv'"):
        TaskTable.load({"path": str(tmp_path / "t.csv")})
    (tmp_path / "t.json").write_text('[{"prompt": "a", "answer": 1}, "oops"]')
    with pytest.raises(TaskDataError, match=r"t.json item 1: a row must be a JSON object, got str"):
        TaskTable.load({"path": str(tmp_path / "t.json")})
    with pytest.raises(EnvConfigError, match="data must be a table"):  # TaskDataError is an EnvConfigError
        build_env("dataset", {"data": "qa.jsonl"})


def _episode(env, task, tokenizer, reply):
    cfg = EnvConfig(name="dataset")
    policy = TokenPolicy(
        ScriptedClient(tokenizer, [reply]), tokenizer, SamplingParams(max_tokens=256), config=cfg
    )
    return asyncio.run(run_episode(env, task, policy, config=cfg, episode_id="ep"))


@pytest.mark.parametrize(
    ("reward", "answer", "reply", "expected"),
    [
        ("exact", "cba", " cba\n", 1.0),
        ("exact", "cba", "it is cba", 0.0),
        ("contains", "cba", "it is cba", 1.0),
        ("number", 42, "so 40 + 2 = 42.", 1.0),
        ("number", "#### 1,234", "answer: 1234", 1.0),
        ("number", 42, "41", 0.0),
        ("lcs", "abcd", "abxd", 0.75),
        ("exact", ["4", "four"], "four", 1.0),
    ],
)
def test_dataset_env_rewards_through_the_rollout_loop(tmp_path, tokenizer, reward, answer, reply, expected):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": answer}])
    env = build_env("dataset", {"data": {"path": str(path), "eval_fraction": 0.0}, "reward": reward}, seed=0)
    task = env.task("train", 0)
    assert task.prompt == [{"role": "user", "content": "q"}] and task.info["row"]["answer"] == answer
    episode = _episode(env, task, tokenizer, reply)
    assert episode.error is None and episode.reward == pytest.approx(expected)
    assert set(episode.rewards) == {reward, "exact"} and len(episode.samples) == 1
    ref = env.reference(task)[0]["content"]
    assert _episode(env, task, tokenizer, ref).reward == 1.0  # the reference (sft-data) solves it


def test_dataset_env_arguments_are_checked(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": 1}])
    with pytest.raises(
        TaskDataError, match=r"unknown reward 'fuzzy'; choose one of \['contains', 'exact', 'lcs', 'number'\]"
    ):
        build_env("dataset", {"data": {"path": str(path)}, "reward": "fuzzy"})
    with pytest.raises(TaskDataError, match="data.answer_field is empty"):
        build_env("dataset", {"data": {"path": str(path), "answer_field": ""}})
    with pytest.raises(EnvConfigError, match="datta"):
        build_env("dataset", {"datta": {"path": str(path)}})
