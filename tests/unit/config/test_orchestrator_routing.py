"""`routing` and `[concurrency]` of the orchestrator's config: the names kept, the errors clear."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.config import ConfigError, load_config
from asyncrl.config.orchestrator import OrchestratorConfig


def test_routing_takes_the_three_modes_or_a_router_url():
    assert OrchestratorConfig(model="m").routing == "cache_aware"
    for mode in ("cache_aware", "least_loaded", "random"):
        cfg = OrchestratorConfig(model="m", routing=mode)
        assert cfg.routing == mode and cfg.router_url is None
    cfg = load_config(OrchestratorConfig, ["--model", "m", "--routing", "https://router.internal:30000/"])
    assert cfg.router_url == "https://router.internal:30000"


@pytest.mark.parametrize("bad", ["cache-aware", "round_robin", "router:30000", "http://"])
def test_an_unknown_routing_names_the_choices(bad):
    with pytest.raises(ValidationError, match="'cache_aware', 'least_loaded', 'random', or the http"):
        OrchestratorConfig(model="m", routing=bad)


def test_a_router_url_cannot_skip_the_prefill_decode_hand_over():
    with pytest.raises(ValidationError, match="skip the prefill/decode hand-over"):
        OrchestratorConfig(
            model="m", servers=["http://d:1"], prefill_servers=["http://p:1"], routing="http://router:9"
        )
    pairs = OrchestratorConfig(model="m", servers=["http://d:1"], prefill_servers=["http://p:1"])
    assert pairs.routing == "cache_aware"


def test_concurrency_bounds_are_checked():
    with pytest.raises(
        ConfigError, match=r"min_requests \(64\) is larger than concurrency.max_requests \(8\)"
    ):
        load_config(
            OrchestratorConfig,
            ["--model", "m", "--concurrency.min-requests", "64", "--concurrency.max-requests", "8"],
        )
    with pytest.raises(ValidationError, match="target_kv_usage"):
        OrchestratorConfig(model="m", concurrency={"target_kv_usage": 1.5})
