"""Hugging Face hub model ids (`org/name`, `org/name:QUANT`) resolved through a fake Hugging Face cache.

The cache is built in a tmp dir with the real layout (`models--org--name/{refs/<branch>, snapshots/<commit>/...
-> ../../blobs/<hash>}`) and read by huggingface_hub itself (snapshot_download, get_cached_repo_tree, ...) with
HF_HUB_OFFLINE=1 and HF_HUB_CACHE / HF_HOME pointing at it. Nothing here touches the network: the "online" tests
replace huggingface_hub's three network calls (list_repo_files, snapshot_download, hf_hub_download) with fakes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.model import hub
from pagedserve.model.loader import load_model_config, resolve_model

COMMIT_MAIN = "a" * 40
COMMIT_DEV = "b" * 40
COMMIT_OTHER = "c" * 40


def _tiny_llama(d: Path, tok, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(layers)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, Path | bytes], refs=()) -> Path:
    """One snapshot of `repo_id` in the cache: each file a blob under blobs/, linked from snapshots/<commit>/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for rel, src in files.items():
        data = src if isinstance(src, bytes) else None
        blob = repo / "blobs" / hashlib.sha256(data if data is not None else str(src).encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            blob.write_bytes(data)
        elif not blob.exists():
            blob.symlink_to(src)  # a big file (the bundled GGUF): the blob links to it instead of a copy
        link = repo / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


def _dir_files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tok(bundled_path):
    from pagedserve.model.loader import load_hf_tokenizer

    return load_hf_tokenizer(bundled_path)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"one": _tiny_llama(root / "one-layer", tok, 1), "two": _tiny_llama(root / "two-layers", tok, 2)}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, models, bundled_path) -> Path:
    """HF_HOME of a fake cache (the cache itself is HF_HOME/hub, huggingface_hub's default)."""
    home = tmp_path_factory.mktemp("hf-home")
    cache = home / "hub"
    one, two = _dir_files(models["one"]), _dir_files(models["two"])
    _add_snapshot(cache, "org/tiny", COMMIT_MAIN, one, refs=["main"])
    _add_snapshot(cache, "org/tiny", COMMIT_DEV, two, refs=["dev"])
    _add_snapshot(cache, "org/no-weights", COMMIT_MAIN,
                  {k: v for k, v in one.items() if not k.endswith(".safetensors")}, refs=["main"])
    # Sharded weights whose second shard's blob was deleted (a dangling link, as after a cache clean-up).
    import json

    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    snap = _add_snapshot(cache, "org/sharded", COMMIT_MAIN, {
        "config.json": one["config.json"], "tokenizer.json": one["tokenizer.json"],
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": b"shard one", "model-00002-of-00002.safetensors": b"shard two",
    }, refs=["main"])
    (snap / "model-00002-of-00002.safetensors").resolve().unlink()
    # A repo whose tree listing the cache recorded (as snapshot_download does): missing files are known exactly.
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    listed = {k: v for k, v in one.items() if k not in ("generation_config.json", "model.safetensors")}
    _add_snapshot(cache, "org/listed", COMMIT_MAIN, listed, refs=["main"])
    write_tree_cache(str(cache / "models--org--listed"), COMMIT_MAIN,
                     {f: TreeCacheEntry(size=1, blob_id="0" * 40) for f in [*one, "README.md"]})
    gguf_files = {name: b"GGUF" for name in (
        "tiny-Q4_K_M.gguf", "tiny-UD-Q4_K_M.gguf", "tiny-q8_0.gguf", "mmproj-tiny-F16.gguf", "tiny-F16.gguf",
        "Q6_K/tiny-Q6_K-00001-of-00002.gguf", "Q6_K/tiny-Q6_K-00002-of-00002.gguf")}
    _add_snapshot(cache, "org/tiny-GGUF", COMMIT_MAIN, gguf_files, refs=["main"])
    _add_snapshot(cache, "org/smol-GGUF", COMMIT_OTHER, {"SmolLM2-135M-Instruct.Q4_1.gguf": Path(bundled_path)},
                  refs=["main"])
    return home


@pytest.fixture
def cache(hf_home, monkeypatch) -> Path:
    """Point huggingface_hub at the fake cache, offline. Its constants are read once at import, so they are
    patched along with the environment."""
    import huggingface_hub.constants as constants

    c = hf_home / "hub"
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_CACHE", str(c))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(c))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return c


def _snapshot(cache: Path, repo_id: str, commit: str) -> str:
    return str(cache / ("models--" + repo_id.replace("/", "--")) / "snapshots" / commit)


# ---- the fake cache is one huggingface_hub recognises --------------------------------------------
def test_fake_cache_is_a_real_hf_cache(cache):
    import huggingface_hub

    info = {r.repo_id: r for r in huggingface_hub.scan_cache_dir(cache).repos}
    assert {"org/tiny", "org/tiny-GGUF", "org/no-weights"} <= set(info)
    assert {rev.commit_hash: set(rev.refs) for rev in info["org/tiny"].revisions} == {
        COMMIT_MAIN: {"main"}, COMMIT_DEV: {"dev"}}


# ---- ids -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, expected", [
    ("org/name", hub.HubId("org/name", None)),
    ("Qwen/Qwen2.5-0.5B-Instruct", hub.HubId("Qwen/Qwen2.5-0.5B-Instruct", None)),
    ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", hub.HubId("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")),
    ("org/name-GGUF:model.Q8_0.gguf", hub.HubId("org/name-GGUF", "model.Q8_0.gguf")),
    ("/abs/path", None), ("./org/name", None), ("~/org/name", None), ("org/name/sub", None),
    ("bare-name", None), ("org/", None), ("model.gguf", None), ("org/name:", None),
])
def test_parse_hub_id(model, expected):
    assert hub.parse_hub_id(model) == expected


def test_non_id_missing_path_keeps_the_path_error(cache, tmp_path):
    with pytest.raises(ValueError, match="does not exist") as e:
        resolve_model(str(tmp_path / "no-such-model"))
    assert "org/name" in str(e.value)  # says a hub id would be taken too


def test_invalid_repo_id_is_a_model_error(cache):
    with pytest.raises(ValueError, match=r"^model: .*valid Hugging Face repo id"):
        resolve_model("org/na--me")


# ---- resolution through the cache ----------------------------------------------------------------
def test_resolve_by_id(cache):
    path, name = resolve_model("org/tiny")
    assert (path, name) == (_snapshot(cache, "org/tiny", COMMIT_MAIN), "org/tiny")
    cfg, name = load_model_config("org/tiny")
    assert (cfg.num_layers, name) == (1, "org/tiny")


def test_resolve_by_branch_and_by_commit(cache):
    assert resolve_model("org/tiny", revision="dev")[0] == _snapshot(cache, "org/tiny", COMMIT_DEV)
    assert load_model_config("org/tiny", revision="dev")[0].num_layers == 2
    assert resolve_model("org/tiny", revision=COMMIT_MAIN)[0] == _snapshot(cache, "org/tiny", COMMIT_MAIN)
    assert resolve_model("org/tiny", revision=COMMIT_DEV) == (_snapshot(cache, "org/tiny", COMMIT_DEV), "org/tiny")


def test_unknown_revision_offline_says_what_is_missing(cache):
    with pytest.raises(ValueError) as e:
        resolve_model("org/tiny", revision="v9")
    msg = str(e.value)
    assert msg.startswith("model: ")
    for part in ("'org/tiny'", "revision v9", "refs/v9", str(cache), "HF_HUB_OFFLINE", "--revision v9",
                 "hf download org/tiny"):
        assert part in msg, part


def test_missing_repo_offline_lists_what_is_missing_and_where(cache):
    with pytest.raises(ValueError) as e:
        resolve_model("org/absent")
    msg = str(e.value)
    assert msg.startswith("model: 'org/absent' is not a local path")
    for part in ("revision main", f"Hugging Face cache at {cache}", str(cache / "models--org--absent"),
                 "config.json", "tokenizer", "*.safetensors", "HF_HUB_OFFLINE=1", "HF_HUB_OFFLINE=0",
                 "hf download org/absent --include '*.json' --include '*.safetensors'", "huggingface-cli download"):
        assert part in msg, part


def test_missing_weights_in_snapshot(cache):
    with pytest.raises(ValueError) as e:
        resolve_model("org/no-weights")
    msg = str(e.value)
    snap = _snapshot(cache, "org/no-weights", COMMIT_MAIN)
    assert msg.startswith("model: the cached snapshot of the Hugging Face repo 'org/no-weights'")
    for part in (f"commit {COMMIT_MAIN}", snap, "missing *.safetensors weights", "HF_HUB_OFFLINE",
                 "hf download org/no-weights --include '*.safetensors'"):
        assert part in msg, part


def test_missing_shard_is_named(cache):
    with pytest.raises(ValueError, match=r"is missing model-00002-of-00002\.safetensors\.") as e:
        resolve_model("org/sharded")
    assert "hf download org/sharded model-00002-of-00002.safetensors" in str(e.value)


def test_cached_tree_listing_names_each_missing_file(cache):
    with pytest.raises(ValueError, match="is missing generation_config.json, model.safetensors. HF_HUB_OFFLINE"):
        resolve_model("org/listed")


def test_local_dir_beats_hub_id(cache, models, tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny"
    shutil.copytree(models["two"], local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == ("org/tiny", "tiny")
    assert load_model_config("org/tiny", revision="dev")[0].num_layers == 2  # a local path ignores the revision
    monkeypatch.chdir(tmp_path / "org")
    assert resolve_model("org/tiny")[0] == _snapshot(cache, "org/tiny", COMMIT_MAIN)


# ---- GGUF repos ----------------------------------------------------------------------------------
def test_gguf_quant_selector(cache):
    snap = _snapshot(cache, "org/tiny-GGUF", COMMIT_MAIN)
    assert resolve_model("org/tiny-GGUF:Q4_K_M") == (f"{snap}/tiny-Q4_K_M.gguf", "org/tiny-GGUF:Q4_K_M")
    assert resolve_model("org/tiny-GGUF:Q8_0")[0] == f"{snap}/tiny-q8_0.gguf"  # case-insensitive
    assert resolve_model("org/tiny-GGUF:UD-Q4_K_M")[0] == f"{snap}/tiny-UD-Q4_K_M.gguf"
    assert resolve_model("org/tiny-GGUF:F16")[0] == f"{snap}/tiny-F16.gguf"  # never the mmproj file
    assert resolve_model("org/tiny-GGUF:tiny-UD-Q4_K_M.gguf")[0] == f"{snap}/tiny-UD-Q4_K_M.gguf"


def test_gguf_quant_not_there(cache):
    with pytest.raises(ValueError) as e:
        resolve_model("org/tiny-GGUF:Q5_K_M")
    msg = str(e.value)
    assert "no single-file GGUF matching 'Q5_K_M'" in msg and "tiny-Q4_K_M.gguf" in msg
    assert "hf download org/tiny-GGUF --include '*Q5_K_M*.gguf'" in msg
    with pytest.raises(ValueError, match="split into 2 files"):
        resolve_model("org/tiny-GGUF:Q6_K")


def test_gguf_repo_without_selector(cache):
    with pytest.raises(ValueError, match=r"is a GGUF repo \(no config.json\): .* e\.g\. org/tiny-GGUF:Q4_K_M"):
        resolve_model("org/tiny-GGUF")


def test_gguf_model_config_through_hub(cache):
    cfg, name = load_model_config("org/smol-GGUF:Q4_1")
    assert name == "org/smol-GGUF:Q4_1" and cfg.num_layers == 30


# ---- the engine, the offline API and the CLI -----------------------------------------------------
def test_llm_loads_and_generates_from_the_cache(cache, models):
    from pagedserve import LLM, SamplingParams

    kw = dict(dtype="float32", num_kv_blocks=32, use_cpp_kernels=False, attention_backend="torch_ref")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM("org/tiny", **kw)
    assert llm.engine.served_model_name == "org/tiny"
    assert llm.engine.model_path == _snapshot(cache, "org/tiny", COMMIT_MAIN)
    out = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6
    local = LLM(str(models["one"]), **kw).generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == local.token_ids
    dev = LLM("org/tiny", revision="dev", **kw)
    assert dev.engine.model_config.num_layers == 2 and dev.engine.served_model_name == "org/tiny"


def test_revision_is_a_flag_and_a_config_field():
    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.cli.args import engine_config_from_args
    from pagedserve.entrypoints.cli.main import build_parser

    for argv in (["serve", "org/tiny"], ["generate", "hi", "--model", "org/tiny"], ["chat", "org/tiny"],
                 ["bench", "latency", "--model", "org/tiny"]):
        cfg = engine_config_from_args(build_parser().parse_args([*argv, "--revision", "dev"]))
        assert (cfg.model, cfg.revision) == ("org/tiny", "dev"), argv
    assert build_parser().parse_args(["kv", "--model", "org/tiny", "--revision", "dev"]).revision == "dev"
    with pytest.raises(ValueError, match="^revision: "):
        EngineConfig(revision="")


def test_cli_kv_reads_a_hub_id(cache, capsys):
    from pagedserve.entrypoints.cli.main import main

    assert main(["kv", "--model", "org/tiny", "--revision", "dev"]) == 0
    assert "model org/tiny" in capsys.readouterr().out
    assert main(["kv", "--model", "org/absent"]) == 2
    assert capsys.readouterr().err.startswith("error: model: 'org/absent' is not a local path")


def test_cli_honours_hf_home_and_hf_hub_offline_from_the_environment(hf_home, tmp_path):
    """A fresh process: huggingface_hub reads HF_HOME (cache = HF_HOME/hub) and HF_HUB_OFFLINE itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli.main", "kv", "--model", "org/tiny", "--revision", "dev"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "model org/tiny" in run.stdout and "2 layers" in run.stdout
    run = subprocess.run([*cmd[:-3], "org/absent"], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 2 and f"Hugging Face cache at {hf_home / 'hub'}" in run.stderr, run.stderr


# ---- with a Hub (faked: nothing leaves the machine) ----------------------------------------------
@pytest.fixture
def online(cache, monkeypatch, tmp_path):
    """HF_HUB_OFFLINE off, and huggingface_hub's network calls replaced by a fake Hub serving `files` (a
    download writes the files asked for into a snapshot folder named after COMMIT_MAIN)."""
    import huggingface_hub
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")

    class FakeHub:
        def __init__(self) -> None:
            self.files: list[str] = []
            self.contents: dict[str, bytes] = {}
            self.calls: list[tuple] = []
            self.list_error: Exception | None = None
            self.snapshot = tmp_path / "downloads" / COMMIT_MAIN

        def list_repo_files(self, repo_id, revision=None, **kw):
            self.calls.append(("list", repo_id, revision))
            if self.list_error is not None:
                raise self.list_error
            return list(self.files)

        def snapshot_download(self, repo_id, revision=None, allow_patterns=None, **kw):
            self.calls.append(("snapshot", repo_id, revision, sorted(allow_patterns)))
            for f in allow_patterns:
                assert f in self.files, f"asked for {f}, which the repo does not have"
                (self.snapshot / f).parent.mkdir(parents=True, exist_ok=True)
                (self.snapshot / f).write_bytes(self.contents.get(f, b"{}"))
            return str(self.snapshot)

        def hf_hub_download(self, repo_id, filename, revision=None, **kw):
            self.calls.append(("file", repo_id, revision, filename))
            return f"/fake/{filename}"

    fake = FakeHub()
    real_snapshot = huggingface_hub.snapshot_download

    def snapshot(repo_id, **kw):  # cache look-ups (local_files_only) stay the library's own
        return real_snapshot(repo_id, **kw) if kw.get("local_files_only") else fake.snapshot_download(repo_id, **kw)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", fake.list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    return fake


def test_online_downloads_only_what_pagedserve_loads(online):
    online.files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "chat_template.jinja", "model.safetensors", "README.md",
                    ".gitattributes", "pytorch_model.bin", "consolidated.safetensors", "onnx/model.safetensors",
                    "original/params.json", "additional_chat_templates/tool_use.jinja"]
    path, name = resolve_model("org/tiny", revision="dev")
    assert (path, name) == (str(online.snapshot), "org/tiny")
    assert online.calls == [
        ("list", "org/tiny", "dev"),
        ("snapshot", "org/tiny", "dev", ["additional_chat_templates/tool_use.jinja", "chat_template.jinja",
                                         "config.json", "generation_config.json", "special_tokens_map.json",
                                         "tokenizer.json", "tokenizer_config.json"]),
        # the weights of the commit the first call resolved: without an index, every top-level *.safetensors
        ("snapshot", "org/tiny", COMMIT_MAIN, ["consolidated.safetensors", "model.safetensors"]),
    ]


def test_online_sharded_weights_are_the_index_shards(online):
    import json

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    online.files = ["config.json", "tokenizer.json", "model.safetensors.index.json", "consolidated.safetensors",
                    *shards]
    index = {"weight_map": {"a": shards[0], "b": shards[1]}}
    online.contents["model.safetensors.index.json"] = json.dumps(index).encode()
    assert resolve_model("org/big")[0] == str(online.snapshot)
    assert online.calls[1:] == [
        ("snapshot", "org/big", None, ["config.json", "model.safetensors.index.json", "tokenizer.json"]),
        ("snapshot", "org/big", COMMIT_MAIN, shards),  # not consolidated.safetensors
    ]


def test_online_gguf_downloads_one_file(online):
    online.files = ["README.md", "m-Q4_K_M.gguf", "m-UD-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F16.gguf"]
    assert resolve_model("org/m-GGUF:q4_k_m") == ("/fake/m-Q4_K_M.gguf", "org/m-GGUF:q4_k_m")
    assert online.calls == [("list", "org/m-GGUF", None), ("file", "org/m-GGUF", None, "m-Q4_K_M.gguf")]


def test_online_repo_checks_before_downloading(online):
    online.files = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf"]
    with pytest.raises(ValueError, match=r"is a GGUF repo \(no config.json\): .* e\.g\. org/m-GGUF:Q4_K_M"):
        resolve_model("org/m-GGUF")
    online.files = ["config.json", "tokenizer.json", "pytorch_model.bin"]
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights \(it has pytorch_model\.bin"):
        resolve_model("org/old")
    online.files = ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="has no tokenizer files"):
        resolve_model("org/notok")
    assert all(c[0] == "list" for c in online.calls)  # nothing was downloaded


def test_online_repo_not_found_and_revision_not_found(online):
    import httpx2
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/x"))
    online.list_error = RepositoryNotFoundError("404", response=response)
    with pytest.raises(ValueError, match=r"^model: 'org/x' is not a local path, and the Hugging Face repo 'org/x' "
                                         r"does not exist \(or is private"):
        resolve_model("org/x")
    online.list_error = RevisionNotFoundError("404", response=response)
    with pytest.raises(ValueError, match=r"^revision: 'nope' is not a branch, tag or commit"):
        resolve_model("org/x", revision="nope")


def test_network_failure_falls_back_to_the_cache(online, cache):
    import httpx2

    online.list_error = httpx2.ConnectError("no route to host")
    assert resolve_model("org/tiny")[0] == _snapshot(cache, "org/tiny", COMMIT_MAIN)
    with pytest.raises(ValueError) as e:
        resolve_model("org/absent")
    msg = str(e.value)
    assert "could not be reached (ConnectError: no route to host)" in msg and "HF_HUB_OFFLINE=0" in msg
    assert str(cache) in msg
    assert [c[0] for c in online.calls] == ["list", "list"]  # no download was attempted
