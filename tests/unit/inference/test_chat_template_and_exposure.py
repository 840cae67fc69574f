"""Client chat templates run sandboxed and bounded; servers off loopback need a key and weight roots."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.inference import InferenceConfig, is_loopback
from asyncrl.config.rl import RLConfig
from asyncrl.inference.chat_template import render_sandboxed
from asyncrl.inference.request import InvalidRequestError

MESSAGES = [{"role": "user", "content": "hi"}]


def _render(source: str, **kw) -> str:
    return render_sandboxed(source, {"messages": MESSAGES} | kw, timeout_s=0.5, max_chars=10_000)


def test_a_well_behaved_template_renders():
    assert _render("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}") == "<user>hi"


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # silent loops
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
        "{% set ns = namespace(x=0) %}{% for i in range(99999) %}{% for j in range(99999) %}"
        "{% set ns.x = ns.x + 1 %}{% endfor %}{% endfor %}",
    ],
)
def test_a_template_that_never_returns_is_stopped(source):
    with pytest.raises(InvalidRequestError, match="within") as e:
        _render(source)
    assert e.value.field == "chat_template"


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 100000000 }}",
        "{{ 9 ** 99999999 }}",
        "{% for i in range(100000) %}{{ 'abcdefgh' }}{% endfor %}",
        "{{ messages.__class__.__mro__ }}",  # the sandbox refuses dunder access
        "{{ messages.append(1) }}",  # and mutation
        "{{ raise_exception('no') }}",
        "{% for %}",
    ],
)
def test_oversized_unsafe_or_broken_templates_are_400s(source):
    with pytest.raises(InvalidRequestError) as e:
        _render(source)
    assert e.value.field == "chat_template" and e.value.status == 400


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("node7", False),
    ],
)
def test_off_loopback_servers_need_a_key_and_weight_roots(host, loopback):
    assert is_loopback(host) == loopback
    if loopback:
        assert InferenceConfig(model="m", host=host).api_key is None
        return
    with pytest.raises(ValueError, match="api_key"):
        InferenceConfig(model="m", host=host)
    with pytest.raises(ValueError, match="update_weights_roots"):
        InferenceConfig(model="m", host=host, api_key="k")
    assert InferenceConfig(model="m", host=host, api_key="k", update_weights_roots=["/w"]).host == host


def test_the_cli_host_override_is_checked_too():
    with pytest.raises(ConfigError, match="api_key"):
        load_config(InferenceConfig, ["--model", "m", "--host", "0.0.0.0"])


@pytest.mark.parametrize("exposed", [True, False])
def test_rl_generates_a_key_per_run_and_hands_it_to_the_orchestrator(tmp_path, exposed):
    cfg = RLConfig(model="m", run_dir=str(tmp_path / "run"))
    keyed = cfg.with_run_api_key(exposed=exposed)
    if not exposed:  # loopback and not exposed: no key needed
        assert keyed.api_key is None
        keyed = RLConfig(model="m", run_dir=str(tmp_path / "run"), deployment={"host": "10.0.0.1"})
        keyed = keyed.with_run_api_key(exposed=False)
    assert keyed.api_key and keyed.api_key != cfg.with_run_api_key(exposed=True).api_key
    resolved = keyed.resolve()
    assert resolved.orchestrator.api_key == keyed.api_key
    assert all(inf.api_key == keyed.api_key for inf in resolved.inference)
    assert resolved.inference[0].update_weights_roots == [str((tmp_path / "run" / "weights").resolve())]
    # the slurm script's --host 0.0.0.0 override then validates
    data = resolved.inference[0].model_dump() | {"host": "0.0.0.0"}
    assert InferenceConfig(**data).host == "0.0.0.0"


def test_sections_cannot_set_the_shared_key(tmp_path):
    with pytest.raises(ConfigError, match="api_key"):
        load_config(RLConfig, {"model": "m", "run_dir": str(tmp_path), "orchestrator": {"api_key": "x"}})
