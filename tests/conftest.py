"""Shared fixtures: a tiny offline model and tokenizer, fresh for each test."""

import pytest
import torch

from forge.core.tiny import build_tiny_model, build_tiny_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    model, _ = build_tiny_model(tiny_tokenizer, seed=0)
    return model
