"""Shared fixtures. Engines on the bundled model are expensive to build (~2 s once the GGUF weights
are cached in-process), so the common configurations are session-scoped."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Many engines are built on the bundled model: dequantize its GGUF once per test process.
os.environ.setdefault("PAGEDSERVE_KEEP_DEQUANTIZED", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def bundled_path() -> str:
    from pagedserve.model.loader import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def llm_fp32():
    """The bundled model in float32 (the exact reference mode) with default engine settings."""
    from pagedserve import LLM

    return LLM(dtype="float32", seed=0)


@pytest.fixture(scope="session")
def hf_bundled(bundled_path):
    """transformers' own model and tokenizer from the same GGUF, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = os.path.split(bundled_path)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32).eval()
    return model, tok
