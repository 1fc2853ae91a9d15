"""Fixtures of the compression unit tests: tiny random Llama models and a tiny BPE tokenizer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from unit.compress.tinyllama import make_tiny, make_tokenizer, tiny_texts  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny(tiny_tokenizer):
    return make_tiny(len(tiny_tokenizer))


@pytest.fixture
def ids(tiny_tokenizer):
    toks = tiny_tokenizer("\n".join(tiny_texts()), add_special_tokens=False)["input_ids"][:512]
    return torch.tensor(toks).view(8, 64)
