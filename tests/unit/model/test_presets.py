"""Presets that derive from another keep its layers: only what their comment names differs."""

from __future__ import annotations

from dataclasses import replace

from asyncrl.model import preset_args


def test_tiny_glm5_32k_is_tiny_glm5_with_a_32k_context_and_top_512_keys():
    base, long = preset_args("tiny-glm5"), preset_args("tiny-glm5-32k")
    assert long.max_position_embeddings == 32768 and long.index_topk == 512
    assert (
        replace(long, max_position_embeddings=base.max_position_embeddings, index_topk=base.index_topk)
        == base
    )
