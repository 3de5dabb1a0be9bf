"""Bad model paths and files fail with a ValueError that says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedserve.model import loader
from pagedserve.model.loader import load_model, load_model_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    d = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_valid_tiny_dir_loads(tiny_dir):
    assert load_model(str(tiny_dir), "float32").config.num_layers == 1


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="does not exist") as e:
        load_model(str(missing))
    assert "no-such-model" in str(e.value)
    with pytest.raises(ValueError, match="does not exist"):
        load_model_config(str(missing))


def test_directory_without_config(tmp_path, tiny_dir):
    d = _copy_model(tiny_dir, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(d))
    with pytest.raises(ValueError, match="no config.json"):
        load_model_config(str(d))


def test_config_not_json(tmp_path, tiny_dir):
    d = _copy_model(tiny_dir, tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(d))


def test_unsupported_architecture(tmp_path, tiny_dir):
    d = _copy_model(tiny_dir, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        load_model(str(d))
    assert "GPT2LMHeadModel" in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_truncated_safetensors(tmp_path, tiny_dir):
    d = _copy_model(tiny_dir, tmp_path / "trunc")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt") as e:
        load_model(str(d))
    assert "model.safetensors" in str(e.value)


def test_no_weights(tmp_path, tiny_dir):
    d = _copy_model(tiny_dir, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no .*safetensors"):
        load_model(str(d))


def test_missing_shard(tmp_path, tiny_dir):
    d = _copy_model(tiny_dir, tmp_path / "shards")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing") as e:
        load_model(str(d))
    assert "model-00002-of-00002.safetensors" in str(e.value)


def test_missing_weight(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file

    d = _copy_model(tiny_dir, tmp_path / "partial")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights") as e:
        load_model(str(d))
    assert "qkv_proj" in str(e.value)


def test_wrong_shape(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file

    d = _copy_model(tiny_dir, tmp_path / "shape")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"norm.weight.*shape \(31,\), expected \(32,\)"):
        load_model(str(d))


def _write_gguf(path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_unsupported_architecture(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_dequantized_gguf", loader._dequantized_gguf.__wrapped__)
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(str(path))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model_config(str(path))


def test_not_a_gguf_file(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_dequantized_gguf", loader._dequantized_gguf.__wrapped__)
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(str(path))


def test_other_file_type(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither a directory .* nor a .gguf file"):
        load_model(str(path))


def test_bad_dtype(tiny_dir):
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tiny_dir), "float16")
