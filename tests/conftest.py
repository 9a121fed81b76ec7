"""Shared fixtures: a tiny offline model and tokenizer, fresh for each test."""

import os

import pytest
import torch

from forge.model.tiny import build_tiny_model, build_tiny_tokenizer

torch.set_num_threads(1)
# dtype="auto" is bf16 on a CPU with bf16 units (AMX, AVX512-BF16) and fp32 elsewhere; the suite's comparisons
# (resume bit for bit, 1 vs 2 processes, optimised vs plain update) have fp32 tolerances, and its result must not
# depend on the CPU CI draws. So "auto" means fp32 here, subprocesses included; tests of bf16 ask for
# dtype="bfloat16" by name (tests/units/test_precision.py), and the detection test unsets this.
os.environ["FORGE_CPU_BF16"] = "0"


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The tiny model and its tokenizer saved like a hub checkpoint, so `model=` can be a name as in TRL."""
    folder = tmp_path_factory.mktemp("tiny")
    model, tokenizer = build_tiny_model(seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def tiny_model(tiny_tokenizer):
    model, _ = build_tiny_model(tiny_tokenizer, seed=0)
    return model
