"""`asyncrl <command>`: a config mistake is one message naming the command and exit code 2, everywhere."""

from __future__ import annotations

import pytest

from asyncrl.launcher.cli import main


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        ("sft", ["--max-steps", "3", "--bogus", "1"], "unknown key 'bogus'"),
        ("trainer", ["--optim.lr", "fast"], "'optim.lr': Input should be a valid number"),
        ("inference", ["--model", "m", "--prt", "1"], "unknown key 'prt' (did you mean 'port'?)"),
        ("orchestrator", ["--batch-sise", "8"], "unknown key 'batch_sise' (did you mean 'batch_size'?)"),
        ("rl", ["--model", "m", "--max_step", "3"], "unknown key 'max_step' (did you mean 'max_steps'?)"),
    ],
)
def test_a_config_mistake_is_one_message_and_exit_code_2(command, argv, message, capsys):
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncrl {command}: invalid config:") and message in err
    assert "Traceback" not in err
