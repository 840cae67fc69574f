"""Tasks read from disk: JSONL, JSON, Parquet, or a `datasets` directory written by `save_to_disk`.

    table = TaskTable.load({"path": "data/qa.jsonl", "prompt_field": "question"}, seed=0)
    table.size("train"), table.size("eval")
    row = table.row("train", 17)           # a TaskRow: prompt messages, answer, the whole source row

The `data` table of an environment's args (the built-in `dataset` env, or any factory that calls
`TaskTable.load`)::

    data = { path = "qa.parquet", prompt_field = "question", answer_field = "answer" }
    data = { path = "train.jsonl", eval_path = "test.jsonl" }
    data = { path = "my_dataset_dict", split = "train", eval_split = "test" }   # save_to_disk dir

Splits: `eval_path` (a second source) or `eval_split` (a split of a saved `DatasetDict`) give the
eval rows; without either, rows go to eval by a hash of their content (`eval_fraction`, 1 in 8 by
default), so duplicates never straddle the splits and the assignment does not change with the seed.
Order: `row(split, i)` walks a permutation of the split drawn from (seed, split, epoch), a new one
for each pass over it (`shuffle = false` keeps the file order). Everything is read and checked
once, when the environment is built: a missing file, an unreadable row, a missing field or a
malformed prompt raises `TaskDataError` naming the file, the row and the field.

Parquet files and `save_to_disk` directories are read with pyarrow (`pip install -e ".[data]"`);
`datasets` itself is not needed. Nothing is downloaded: paths are local (relative ones are taken
from the working directory).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from asyncrl.config.jsonl import JsonlError, parse_jsonl
from asyncrl.envs.base import EnvConfigError, Split

__all__ = ["TaskDataConfig", "TaskDataError", "TaskRow", "TaskTable", "read_rows"]

ROLES = ("system", "user", "assistant", "tool")
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
_NO_PYARROW = 'reading {what} needs pyarrow: pip install -e ".[data]"'


class TaskDataError(EnvConfigError):
    """Task data that cannot be used: the message names the file, the row and the field."""


class TaskDataConfig(BaseModel):
    """Where the tasks are and which fields hold the prompt and the answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, description="a .jsonl/.json/.parquet file or a save_to_disk directory")
    split: str | None = Field(
        None, description="the split of a saved DatasetDict to train on (default 'train')"
    )
    eval_path: str | None = Field(None, description="a second source holding the eval tasks")
    eval_split: str | None = Field(None, description="the split of a saved DatasetDict to evaluate on")
    eval_fraction: float | None = Field(
        None, ge=0.0, lt=1.0, description="share of rows hashed to eval when no eval source is given (0.125)"
    )
    prompt_field: str = Field("prompt", min_length=1, description="a string, or a list of {role, content}")
    answer_field: str = Field("answer", description="'' when the rows carry no answer")
    system_prompt: str | None = Field(None, description="prepended to prompts that have no system message")
    shuffle: bool = Field(True, description="seeded permutation per pass; false keeps the file order")

    @model_validator(mode="after")
    def _one_eval_source(self) -> TaskDataConfig:
        if self.eval_fraction is not None and (self.eval_path or self.eval_split):
            raise ValueError(
                "eval_fraction splits one source; it cannot be combined with eval_path/eval_split"
            )
        return self


@dataclass(frozen=True, kw_only=True)
class TaskRow:
    """One task: `prompt` messages, the `answer` (None without answer_field), and the source row."""

    prompt: list[dict[str, Any]]
    answer: Any
    row: dict[str, Any]
    where: str  # "qa.jsonl line 7" / "qa.parquet row 6": for messages about this row


class TaskTable:
    """The train and eval rows of a task source, checked, split and served in a seeded order."""

    def __init__(self, config: TaskDataConfig, rows: dict[Split, list[TaskRow]], *, seed: int = 0) -> None:
        self.config, self.seed, self._rows = config, seed, rows
        self._orders: dict[tuple[Split, int], list[int]] = {}

    @classmethod
    def load(cls, data: TaskDataConfig | dict[str, Any], *, seed: int = 0) -> TaskTable:
        config = _config(data)
        train_raw = _read_source(config.path, config.split, default_split="train")
        if config.eval_path:
            eval_raw = _read_source(config.eval_path, config.eval_split, default_split=None)
        elif config.eval_split:
            eval_raw = _read_source(config.path, config.eval_split, default_split=None)
        else:
            fraction = 0.125 if config.eval_fraction is None else config.eval_fraction
            eval_raw = [r for r in train_raw if _hashed_to_eval(r[1], fraction)]
            train_raw = [r for r in train_raw if not _hashed_to_eval(r[1], fraction)]
        rows: dict[Split, list[TaskRow]] = {
            "train": [_task_row(config, where, row) for where, row in train_raw],
            "eval": [_task_row(config, where, row) for where, row in eval_raw],
        }
        if not rows["train"]:
            raise TaskDataError(
                f"{config.path}: no train tasks (the source is empty, or every row went to eval)"
            )
        return cls(config, rows, seed=seed)

    def size(self, split: Split) -> int:
        return len(self._rows[split])

    def row(self, split: Split, index: int) -> TaskRow:
        """Row `index` of `split`'s endless stream: pass `index // size`, position `index % size`."""
        rows = self._rows[split]
        if not rows:
            raise TaskDataError(
                f"{self.config.path}: no {split} tasks; give data.eval_path or data.eval_split, or raise "
                "data.eval_fraction (it is 0, or the source is too small for any row to hash to eval)"
            )
        if index < 0:
            raise IndexError(f"task index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(rows))
        return rows[self._order(split, epoch)[pos]]

    def _order(self, split: Split, epoch: int) -> list[int]:
        n = len(self._rows[split])
        if not self.config.shuffle:
            return list(range(n))
        key = (split, epoch)
        if key not in self._orders:
            if len(self._orders) > 8:  # a stream only moves forward: keep the newest passes
                self._orders.clear()
            order = list(range(n))
            random.Random(f"{self.seed}/{split}/{epoch}").shuffle(order)
            self._orders[key] = order
        return self._orders[key]


def _config(data: TaskDataConfig | dict[str, Any]) -> TaskDataConfig:
    if isinstance(data, TaskDataConfig):
        return data
    if not isinstance(data, dict):
        raise TaskDataError(
            f"data must be a table like {{ path = 'tasks.jsonl' }}, got {type(data).__name__}"
        )
    try:
        return TaskDataConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(".".join(["data", *map(str, x["loc"])]) + f": {x['msg']}" for x in e.errors())
        raise TaskDataError(f"bad task data settings: {problems}") from None


def _hashed_to_eval(row: dict[str, Any], fraction: float) -> bool:
    content = json.dumps(row, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(content).digest()[:8], "little") < fraction * 2**64


def _task_row(config: TaskDataConfig, where: str, row: dict[str, Any]) -> TaskRow:
    fields = sorted(row)
    if config.prompt_field not in row:
        raise TaskDataError(
            f"{where}: no field {config.prompt_field!r} (the row has {fields}); set data.prompt_field"
        )
    if config.answer_field and config.answer_field not in row:
        raise TaskDataError(
            f"{where}: no field {config.answer_field!r} (the row has {fields}); set data.answer_field "
            "(or answer_field = '' for rows without answers)"
        )
    prompt = _messages(where, config.prompt_field, row[config.prompt_field])
    if config.system_prompt and prompt[0]["role"] != "system":
        prompt.insert(0, {"role": "system", "content": config.system_prompt})
    answer = row[config.answer_field] if config.answer_field else None
    if config.answer_field and answer is None:
        raise TaskDataError(f"{where}: field {config.answer_field!r} is null")
    return TaskRow(prompt=prompt, answer=answer, row=row, where=where)


def _messages(where: str, field: str, value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if not value.strip():
            raise TaskDataError(f"{where}: field {field!r} is an empty string")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise TaskDataError(
            f"{where}: field {field!r} must be a string or a non-empty list of {{role, content}} messages, "
            f"got {type(value).__name__}"
        )
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise TaskDataError(
                f"{where}: {field}[{i}] must be a message {{role: one of {list(ROLES)}, content: a string}}, "
                f"got {m!r:.200}"
            )
        messages.append({k: v for k, v in m.items() if v is not None})
    return messages


def read_rows(path: str | Path, split: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) pairs of a JSONL/JSON/Parquet file or a save_to_disk directory, in stored order."""
    return _read_source(str(path), split, default_split="train")


def _read_source(
    path: str, split: str | None, *, default_split: str | None
) -> list[tuple[str, dict[str, Any]]]:
    p = Path(path).expanduser()
    if not p.exists():
        raise TaskDataError(f"task data {path!r} does not exist (resolved to {p.absolute()})")
    if p.is_dir():
        return _read_saved_dataset(p, split, default_split)
    if split is not None:
        raise TaskDataError(f"{path}: split {split!r} given, but only a save_to_disk directory has splits")
    suffix = p.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return _read_json(p)
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(p)
    raise TaskDataError(
        f"{path}: unknown task data format {suffix or '(no suffix)'!r}; use "
        f"{list(JSON_SUFFIXES + PARQUET_SUFFIXES)} or a directory written by datasets' save_to_disk"
    )


def _read_json(p: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{p}: not UTF-8 text ({e})") from None
    if p.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{p}: not valid JSON: {e}") from None
        return [(f"{p.name} item {i}", _object(f"{p.name} item {i}", item)) for i, item in enumerate(items)]
    try:
        rows = parse_jsonl(text)
    except JsonlError as e:
        raise TaskDataError(f"{p.name} line {e.line}: {e.reason}") from None
    return [(f"{p.name} line {n}", row) for n, row in rows]


def _object(where: str, item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise TaskDataError(f"{where}: a row must be a JSON object, got {type(item).__name__}")
    return item


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow as pa
    except ImportError:
        raise TaskDataError(_NO_PYARROW.format(what=what)) from None
    return pa


def _read_parquet(p: Path) -> list[tuple[str, dict[str, Any]]]:
    _pyarrow(f"{p.name} (Parquet)")
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for a damaged file
        raise TaskDataError(f"{p}: not a readable Parquet file: {e}") from None
    return [(f"{p.name} row {i}", row) for i, row in enumerate(table.to_pylist())]


def _read_saved_dataset(
    p: Path, split: str | None, default_split: str | None, *, label: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    dict_file = p / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text()).get("splits", [])
        chosen = split or default_split
        if chosen is None:
            raise TaskDataError(f"{p} holds splits {splits}; name one with data.eval_split")
        if chosen not in splits:
            raise TaskDataError(
                f"{p}: no split {chosen!r}; it holds {splits} (set data.split / data.eval_split)"
            )
        return _read_saved_dataset(p / chosen, None, None, label=f"{p.name}[{chosen}]")
    state_file = p / "state.json"
    if not state_file.is_file():
        raise TaskDataError(
            f"{p}: a directory must be written by datasets' save_to_disk (state.json or dataset_dict.json); "
            "for other files give the file itself"
        )
    if split is not None:
        raise TaskDataError(
            f"{p}: split {split!r} given, but this is a single saved Dataset, not a DatasetDict"
        )
    pa = _pyarrow(f"{p} (a save_to_disk directory)")
    files = [f["filename"] for f in json.loads(state_file.read_text()).get("_data_files", [])]
    if not files:
        raise TaskDataError(f"{p}/state.json lists no data files")
    rows: list[tuple[str, dict[str, Any]]] = []
    for name in files:
        shard = p / name
        if not shard.is_file():
            raise TaskDataError(f"{p}: data file {name} listed in state.json is missing")
        try:
            with pa.memory_map(str(shard)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except Exception as e:  # ArrowInvalid for a damaged shard
            raise TaskDataError(f"{shard}: not a readable Arrow file: {e}") from None
        rows.extend(
            (f"{label or p.name} row {len(rows) + i}", row) for i, row in enumerate(table.to_pylist())
        )
    return rows
