"""Shared fixtures. Engines on the bundled model are expensive to build (~2 s once the GGUF weights
are cached in-process), so the common configurations are session-scoped."""

from __future__ import annotations

import functools
import gc
import os
import sys

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton kernels (the CUDA attention backend) run through Triton's interpreter where there is no GPU;
# set before anything imports triton (it reads the variable when a kernel is decorated).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Many engines are built on the bundled model: dequantize its GGUF once per test process.
os.environ.setdefault("PAGEDSERVE_KEEP_DEQUANTIZED", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module", autouse=True)
def _release_finished_apps():
    """After each module: FastAPI's caches of which endpoint callables are generators (functools.lru_cache, 4,096
    entries, in fastapi.dependencies.models, FastAPI 0.165) hold every app's endpoint closures, and through them its
    engine with its model and its 2 GiB KV cache (written through at start: resident), after the module's fixture has
    shut the server down. Module after module the suite's process grew to 20.8 GB resident on a 24 GiB machine (a
    per-test RSS log); clearing those caches lets the finished apps' engines go (an engine and its app: 2.74 -> 0.48
    GB). Live apps keep their references: nothing of theirs is freed."""
    yield
    models = sys.modules.get("fastapi.dependencies.models")
    if models is None:
        return
    for value in vars(models).values():
        if isinstance(value, functools._lru_cache_wrapper):
            value.cache_clear()
    gc.collect()


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


@pytest.fixture(scope="session")
def hf_gguf_parse_once():
    """A context manager under which transformers' loads from a GGUF share the work they would repeat: each
    `from_pretrained(..., gguf_file=...)` parses the whole file with gguf-py's GGUFReader (a Python object per
    vocabulary entry: seconds, and ~30 s for a 262k vocabulary) once for the config and again for the weights
    (and once more for a tokenizer), and builds gguf-py's tensor-name map once per submodule of the model
    (~400 identical maps). Inside it, transformers gets one reader per file (read-only: a memory map and the
    parsed fields, which it only reads) and one name map per (architecture, layers) — the same objects it
    would build again, so the loaded model and tokenizer are the same. pagedserve's own reads of the file
    (model/loader.py) still build their own reader, unless with_pagedserve=True: then its loader gets the
    same reader too (it only reads it; it frees the reader's fields after its read, which the kept reader
    delays until clear()). It yields the readers it keeps (clear() frees them)."""
    import contextlib
    import functools
    import sys

    import gguf

    @contextlib.contextmanager
    def parse_once(with_pagedserve: bool = False):
        real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, int, int], object] = {}
        sharing = {"transformers.modeling_gguf_pytorch_utils"}
        if with_pagedserve:
            sharing.add("pagedserve.model.loader")

        def reader(path, mode="r"):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if mode != "r" or caller not in sharing:
                return real_reader(path, mode)
            st = os.stat(path)
            key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
            if key not in readers:
                readers[key] = real_reader(path)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_name_map)
        try:
            yield readers
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map
            readers.clear()

    return parse_once
