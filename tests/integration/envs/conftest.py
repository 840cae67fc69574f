"""Shared fixtures: the byte-level ChatML tokenizer of our tiny models (written once per session)."""

from __future__ import annotations

import pytest

from asyncrl.envs import ChatTokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    from asyncrl.model.tokenizer import save_byte_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return ChatTokenizer.from_pretrained(path)
