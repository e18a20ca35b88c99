"""Tokenizer fixtures shared by the router tests (see tokenizer_builders for how they are built)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from router.tokenizer import Tokenizer
from tests.router.tokenizer_builders import (
    BASE_CONFIG,
    build_byte_fallback_bpe,
    save_model_dir,
    train_byte_level_bpe,
    train_metaspace_bpe,
    train_wordpiece,
)


@pytest.fixture(scope="session")
def byte_level_backend() -> BackendTokenizer:
    return train_byte_level_bpe()


@pytest.fixture(scope="session")
def byte_level_dir(tmp_path_factory, byte_level_backend) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("byte_level"), byte_level_backend, BASE_CONFIG)


@pytest.fixture(scope="session")
def byte_level_tokenizer(byte_level_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(byte_level_dir)


@pytest.fixture(scope="session")
def metaspace_dir(tmp_path_factory) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("metaspace"), train_metaspace_bpe(), BASE_CONFIG)


@pytest.fixture(scope="session")
def metaspace_tokenizer(metaspace_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(metaspace_dir)


@pytest.fixture(scope="session")
def byte_fallback_dir(tmp_path_factory) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("byte_fallback"), build_byte_fallback_bpe(), BASE_CONFIG)


@pytest.fixture(scope="session")
def byte_fallback_tokenizer(byte_fallback_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(byte_fallback_dir)


@pytest.fixture(scope="session")
def wordpiece_cleanup_dir(tmp_path_factory) -> Path:
    config = {**BASE_CONFIG, "clean_up_tokenization_spaces": True}
    return save_model_dir(tmp_path_factory.mktemp("wordpiece"), train_wordpiece(), config)
