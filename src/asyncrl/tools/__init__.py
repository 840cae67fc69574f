"""Tools a user runs by hand around a training run, one `asyncrl <command>` each.

| command | module | does |
|---|---|---|
| `asyncrl init-model` | init_model | a randomly initialised HF-format model + tokenizer |
| `asyncrl sft-data` | sft_export | an environment's reference answers as SFT JSONL |
| `asyncrl eval` | engine_eval | mean reward on an env's eval tasks, embedded engine in-process |
| `asyncrl eval-env` | endpoint_eval | the same against any OpenAI-compatible endpoint, or a scripted agent |
| `asyncrl plan` | plan | per-GPU memory and step time of a trainer layout |
| `asyncrl report` | report (+ report_figures) | PNG plots and one HTML page of a run's metrics |
| `asyncrl swe-tasks` | swe_tasks (a package) | SWE-bench-form tasks made from a Python repo by mutation |

They use the process roles' packages as libraries but start no processes; the launcher's CLI
(asyncrl.launcher.cli) is the only importer of this package.
"""
