"""Hugging Face hub model ids, resolved through the local Hugging Face cache with huggingface_hub.

Two forms (a local path of the same name always wins; loader.resolve_model checks that first):

* `org/name`: a transformers-style repo (config.json, tokenizer files, *.safetensors weights);
* `org/name:QUANT`: one single-file GGUF of a GGUF repo, vLLM's `repo_id:quant_type` (e.g.
  `unsloth/Qwen3-0.6B-GGUF:Q4_K_M`, matched case-insensitively against the end of the file names); the
  part after the colon may also be a whole file name ending in `.gguf`.

The served name is the id as given (what `vllm serve org/name` serves). huggingface_hub reads HF_HOME,
HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN and HF_ENDPOINT itself (at import), so they are honoured as everywhere
else in the HF ecosystem. With the Hub reachable, only what pagedserve loads is downloaded: config.json,
generation_config.json, the tokenizer files, the chat template files and the weights (the shards that
model.safetensors.index.json names, else the top-level *.safetensors), or the one GGUF file. Offline
(HF_HUB_OFFLINE=1) or when the Hub cannot be reached, the cached snapshot of the revision is used if it holds
all of that; otherwise a ValueError names the repo, the revision, the missing files, the cache folder and how
to fetch them.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Everything pagedserve reads from a transformers-style repo, besides the weights.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
CHAT_TEMPLATE_DIR = "additional_chat_templates/"
WEIGHTS_INDEX = "model.safetensors.index.json"
# A repo's tokenizer needs at least one of these (fast tokenizer, sentencepiece model, BPE vocabulary).
TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json")
_TOKENIZER_DESC = "a tokenizer (tokenizer.json, tokenizer.model or vocab.json + merges.txt)"
# `hf download` patterns that cover the above (for the hints in error messages).
_HF_INCLUDE = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "merges.txt")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(?::[\w.+-]+)?", re.ASCII)
_GGUF_SHARD = re.compile(r"-\d{5}-of-\d{5}$")


@dataclass(frozen=True)
class HubId:
    repo_id: str
    gguf: str | None  # after the colon: a quant type (Q4_K_M) or a file name ending in .gguf; None: no GGUF


def parse_hub_id(model: str) -> HubId | None:
    """`org/name` or `org/name:QUANT` -> HubId; None for anything else (paths, bare names, deeper paths)."""
    if not isinstance(model, str) or not _HUB_ID.fullmatch(model):
        return None
    repo_id, _, gguf = model.partition(":")
    return HubId(repo_id, gguf or None)


def is_hub_id(model: str) -> bool:
    return parse_hub_id(model) is not None


def resolve_hub_model(model: str, revision: str | None = None) -> tuple[str, str]:
    """(local path, served name) of a hub id: the snapshot folder of a transformers repo, or the path of the
    chosen GGUF file in its snapshot. Downloads what is missing when the Hub can be reached."""
    hub_id = parse_hub_id(model)
    if hub_id is None:
        raise ValueError(f"model: {model!r} is not a Hugging Face repo id (org/name or org/name:QUANT)")
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(hub_id.repo_id)
    except ValueError as e:
        raise ValueError(f"model: {model!r} is not a local path nor a valid Hugging Face repo id: {e}") from e
    ctx = _Ctx(model, hub_id.repo_id, revision)
    listing, network_error = _remote_listing(ctx)
    if hub_id.gguf is None:
        path = _resolve_repo(ctx, listing, network_error)
    else:
        path = _resolve_gguf(ctx, hub_id.gguf, listing, network_error)
    logger.info("model %s (revision %s): %s", model, ctx.rev, path)
    return path, model


# ---- what a repo needs ---------------------------------------------------------------------------
def _is_small_file(path: str) -> bool:
    """Config, tokenizer, chat template and weights-index files (top level, except the chat template dir)."""
    if path.startswith(CHAT_TEMPLATE_DIR):
        return path.endswith(".jinja") and "/" not in path[len(CHAT_TEMPLATE_DIR):]
    return path in (*CONFIG_FILES, *TOKENIZER_FILES, *CHAT_TEMPLATE_FILES, WEIGHTS_INDEX)


def _top_level_safetensors(files) -> list[str]:
    return sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))


def _check_repo_listing(ctx: _Ctx, listing: set[str]) -> None:
    """The repo's file list has what pagedserve loads, or a ValueError saying what it lacks."""
    if "config.json" not in listing:
        ggufs = sorted(f for f in listing if f.endswith(".gguf"))
        if ggufs:
            quants = sorted({q for q in map(_quant_of, ggufs) if q}, key=lambda q: (q.upper() != "Q4_K_M", q))
            example = f"{ctx.repo_id}:{quants[0] if quants else ggufs[0].rsplit('/', 1)[-1]}"
            raise ValueError(
                f"model: {ctx.repo_id!r} (revision {ctx.rev}) is a GGUF repo (no config.json): name one of its "
                f"files as {ctx.repo_id}:QUANT, e.g. {example} (its .gguf files: {_short(ggufs)})"
            )
        raise ValueError(f"model: the Hugging Face repo {ctx.repo_id!r} (revision {ctx.rev}) has no config.json "
                         "(not a transformers model repo)")
    if WEIGHTS_INDEX not in listing and not _top_level_safetensors(listing):
        other = sorted(f for f in listing if f.endswith((".bin", ".pth", ".pt", ".h5", ".msgpack")))
        extra = f" (it has {_short(other)}; pagedserve loads only safetensors or GGUF weights)" if other else ""
        raise ValueError(f"model: the Hugging Face repo {ctx.repo_id!r} (revision {ctx.rev}) has no *.safetensors "
                         f"weights{extra}")
    if not any(f in listing for f in TOKENIZER_CORE):
        raise ValueError(f"model: the Hugging Face repo {ctx.repo_id!r} (revision {ctx.rev}) has no tokenizer "
                         f"files ({', '.join(TOKENIZER_CORE)})")


def _missing_files(folder: str, listing: set[str] | None) -> list[str]:
    """What pagedserve would load that the snapshot folder lacks. With the repo's file list (from the Hub or the
    cache's tree listing) that is exact; without it, the files every model needs."""
    root = Path(folder)

    def have(f: str) -> bool:
        return (root / f).is_file()  # follows the blob link: a link to a deleted blob counts as missing

    if listing is not None:
        missing = [f for f in sorted(listing) if _is_small_file(f) and not have(f)]
    else:
        missing = [] if have("config.json") else ["config.json"]
        if not any(have(f) for f in TOKENIZER_CORE):
            missing.append(_TOKENIZER_DESC)
    if have(WEIGHTS_INDEX):
        missing += [f for f in _index_shards(root / WEIGHTS_INDEX) if not have(f)]
    elif listing is not None:
        if WEIGHTS_INDEX not in listing:  # (a listed index that is absent is already counted above)
            missing += [f for f in _top_level_safetensors(listing) if not have(f)]
    elif not any(p.is_file() for p in root.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    return missing


def _index_shards(index: Path) -> list[str]:
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"model: {index} is not a readable safetensors index: {e}") from e


# ---- the two kinds of repo -----------------------------------------------------------------------
def _resolve_repo(ctx: _Ctx, listing: set[str] | None, network_error: Exception | None) -> str:
    if listing is not None:  # the Hub answered: download exactly what is needed (cached files are reused)
        _check_repo_listing(ctx, listing)
        folder = _download(ctx, sorted(f for f in listing if _is_small_file(f)))
        commit = Path(folder).name  # the snapshot folder is named after the commit: fetch the weights of that one
        index = Path(folder) / WEIGHTS_INDEX
        weights = _index_shards(index) if index.is_file() else _top_level_safetensors(listing)
        folder = _download(ctx, weights, revision=commit)
        missing = _missing_files(folder, listing)
        if missing:
            raise ValueError(_missing_message(ctx, folder, missing, "The download did not produce them."))
        return folder
    folder = _cached_snapshot(ctx, network_error, "config.json, the tokenizer files and the *.safetensors weights "
                              "(and generation_config.json and the chat template files, if the repo has them)")
    listing = _cached_listing(ctx)
    if listing is not None:
        _check_repo_listing(ctx, listing)
    elif not (Path(folder) / "config.json").is_file() and any(Path(folder).rglob("*.gguf")):
        _check_repo_listing(ctx, {str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file()})
    missing = _missing_files(folder, listing)
    if missing:
        raise ValueError(_missing_message(ctx, folder, missing, _offline_reason(network_error)))
    return folder


def _resolve_gguf(ctx: _Ctx, selector: str, listing: set[str] | None, network_error: Exception | None) -> str:
    import huggingface_hub as hfh

    if listing is not None:
        name = _pick_gguf(ctx, selector, listing)
        try:
            return hfh.hf_hub_download(ctx.repo_id, name, revision=ctx.revision)
        except Exception as e:
            raise _download_error(ctx, [name], e) from e
    folder = _cached_snapshot(ctx, network_error, f"one .gguf file for {selector!r}", _gguf_pattern(selector))
    cached = _cached_listing(ctx)
    local = {str(p.relative_to(folder)) for p in Path(folder).rglob("*.gguf") if p.is_file()}
    name = _pick_gguf(ctx, selector, cached if cached is not None else local, folder, network_error)
    if name not in local:
        raise ValueError(_missing_message(ctx, folder, [name], _offline_reason(network_error)))
    return str(Path(folder) / name)


def gguf_matches(selector: str, files) -> list[str]:
    """The single-file GGUFs a `:QUANT` (or `:file.gguf`) selector names, best first (top level, fewest dashes:
    `model-Q4_K_M.gguf` before `sub/model-UD-Q4_K_M.gguf`); multimodal projectors are never chosen."""
    if selector.lower().endswith(".gguf"):
        return sorted(f for f in files if f == selector or f.rsplit("/", 1)[-1] == selector)
    q = selector.lower()
    out = []
    for f in files:
        name = f.rsplit("/", 1)[-1].lower()
        if not name.endswith(".gguf") or "mmproj" in name:
            continue
        stem = name[: -len(".gguf")]
        if stem == q or (stem.endswith(q) and stem[-len(q) - 1] in "-._"):
            out.append(f)
    return sorted(out, key=lambda f: (f.count("/"), f.count("-"), len(f), f))


def _quant_of(filename: str) -> str | None:
    stem = filename.rsplit("/", 1)[-1][: -len(".gguf")]
    if "mmproj" in stem.lower() or _GGUF_SHARD.search(stem):
        return None
    m = re.search(r"[-._]((?:UD-)?I?Q\d\w*|[BF]F?\d+)$", stem, re.IGNORECASE | re.ASCII)
    return m.group(1) if m else None


def _gguf_pattern(selector: str) -> str:
    return selector if selector.lower().endswith(".gguf") else f"*{selector}*.gguf"


def _pick_gguf(ctx: _Ctx, selector: str, files, folder: str | None = None,
               network_error: Exception | None = None) -> str:
    matches = gguf_matches(selector, files)
    if matches:
        if len(matches) > 1:
            logger.info("model %s: %d files match %r, using %s (others: %s)", ctx.model, len(matches), selector,
                        matches[0], ", ".join(matches[1:]))
        return matches[0]
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    q = selector.lower()
    shards = [f for f in ggufs if _GGUF_SHARD.sub("", f.rsplit("/", 1)[-1][:-5]).lower().endswith(q)]
    if shards:
        raise ValueError(f"model: {ctx.model!r}: the {selector} GGUF of {ctx.repo_id} (revision {ctx.rev}) is split "
                         f"into {len(shards)} files ({_short(shards)}); pagedserve loads single-file GGUFs (merge "
                         "them with llama.cpp's `llama-gguf-split --merge` and give the merged file's path)")
    have = f"its .gguf files: {_short(ggufs)}" if ggufs else "it has no .gguf file"
    if folder is None:  # the Hub's own listing: the repo really has no such file
        raise ValueError(f"model: {ctx.model!r}: the Hugging Face repo {ctx.repo_id!r} (revision {ctx.rev}) has "
                         f"no single-file GGUF matching {selector!r} ({have})")
    raise ValueError(f"model: {ctx.model!r}: the cached snapshot {folder} of {ctx.repo_id!r} (revision {ctx.rev}) "
                     f"has no single-file GGUF matching {selector!r} ({have}). {_offline_reason(network_error)} "
                     + _fetch_hint(ctx, [_gguf_pattern(selector)]))


# ---- huggingface_hub calls -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Ctx:
    model: str
    repo_id: str
    revision: str | None

    @property
    def rev(self) -> str:
        return self.revision or "main"


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _storage_folder(ctx: _Ctx) -> Path:
    return Path(_cache_dir()) / ("models--" + ctx.repo_id.replace("/", "--"))


def _network_errors() -> tuple[type[BaseException], ...]:
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub.errors import OfflineModeIsEnabled

    return OfflineModeIsEnabled, httpx2.TransportError


def _is_hub_unavailable(e: BaseException) -> bool:
    """No network, offline mode, or a Hub that is down (5xx / rate-limited): fall back to the cache."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(e, _network_errors()):
        return True
    response = getattr(e, "response", None) if isinstance(e, HfHubHTTPError) else None
    status = getattr(response, "status_code", None)
    return isinstance(status, int) and (status >= 500 or status == 429)


def _repo_error(ctx: _Ctx, e: BaseException) -> ValueError | None:
    """The ValueError for an answer of the Hub about the repo itself (absent, gated, no such revision)."""
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(e, GatedRepoError):
        return ValueError(f"model: the Hugging Face repo {ctx.repo_id!r} is gated: accept its terms on "
                          f"https://huggingface.co/{ctx.repo_id} and {login}")
    if isinstance(e, RepositoryNotFoundError):
        return ValueError(f"model: {ctx.model!r} is not a local path, and the Hugging Face repo {ctx.repo_id!r} "
                          f"does not exist (or is private: {login})")
    if isinstance(e, RevisionNotFoundError):
        return ValueError(f"revision: {ctx.rev!r} is not a branch, tag or commit of the Hugging Face repo "
                          f"{ctx.repo_id!r}")
    if isinstance(e, DisabledRepoError):
        return ValueError(f"model: the Hugging Face repo {ctx.repo_id!r} is disabled")
    status = getattr(getattr(e, "response", None), "status_code", None) if isinstance(e, HfHubHTTPError) else None
    if status in (401, 403):
        return ValueError(f"model: the Hugging Face Hub refused access to {ctx.repo_id!r} ({status}): {login}")
    return None


def _remote_listing(ctx: _Ctx) -> tuple[set[str] | None, Exception | None]:
    """The repo's files at the revision from the Hub; (None, None) offline, (None, error) when unreachable."""
    import huggingface_hub as hfh
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return None, None
    try:
        return set(hfh.list_repo_files(ctx.repo_id, revision=ctx.revision)), None
    except Exception as e:
        if (err := _repo_error(ctx, e)) is not None:
            raise err from e
        if _is_hub_unavailable(e):
            logger.warning("model %s: the Hugging Face Hub cannot be reached (%s: %s); using the local cache",
                           ctx.model, type(e).__name__, e)
            return None, e
        raise ValueError(f"model: listing the files of the Hugging Face repo {ctx.repo_id!r} failed: {e}") from e


def _download(ctx: _Ctx, files: list[str], revision: str | None = None) -> str:
    import huggingface_hub as hfh

    try:
        return hfh.snapshot_download(ctx.repo_id, revision=revision or ctx.revision, allow_patterns=files)
    except Exception as e:
        raise _download_error(ctx, files, e) from e


def _download_error(ctx: _Ctx, files: list[str], e: BaseException) -> ValueError:
    if (err := _repo_error(ctx, e)) is not None:
        return err
    return ValueError(f"model: downloading {_short(files)} of the Hugging Face repo {ctx.repo_id!r} (revision "
                      f"{ctx.rev}) into {_cache_dir()} failed ({type(e).__name__}: {e}). "
                      + _fetch_hint(ctx, files))


def _cached_snapshot(ctx: _Ctx, network_error: Exception | None, needs: str, gguf: str | None = None) -> str:
    """The cached snapshot folder of the revision (from refs/<revision>, or the commit itself); `gguf`: the
    file pattern of a GGUF selector, for the hint."""
    import huggingface_hub as hfh
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        # An empty allow-list: only locate the snapshot; what it must hold is checked here, per file.
        return hfh.snapshot_download(ctx.repo_id, revision=ctx.revision, local_files_only=True, allow_patterns=[])
    except LocalEntryNotFoundError as e:
        storage = _storage_folder(ctx)
        if not storage.is_dir():
            what = f"nothing of the repo is cached (no {storage})"
        else:
            what = f"{storage} has no snapshot for revision {ctx.rev} (no refs/{ctx.rev}, no snapshots/{ctx.rev})"
        patterns = list(_HF_INCLUDE) if gguf is None else [gguf]
        raise ValueError(
            f"model: {ctx.model!r} is not a local path, and the Hugging Face repo {ctx.repo_id!r} (revision "
            f"{ctx.rev}) is not in the Hugging Face cache at {_cache_dir()}: {what}. pagedserve needs {needs}. "
            f"{_offline_reason(network_error)} {_fetch_hint(ctx, patterns)}"
        ) from e


def _cached_listing(ctx: _Ctx) -> set[str] | None:
    """The repo's file list as the cache recorded it at the last download (None if it has none)."""
    import huggingface_hub as hfh
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return {f.path for f in hfh.get_cached_repo_tree(ctx.repo_id, revision=ctx.revision)}
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return None


# ---- messages ------------------------------------------------------------------------------------
def _offline_reason(network_error: Exception | None) -> str:
    if network_error is None:
        return "HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) is set, so nothing is downloaded."
    return f"The Hugging Face Hub could not be reached ({type(network_error).__name__}: {network_error})."


def _fetch_hint(ctx: _Ctx, patterns: list[str] | None = None) -> str:
    """How to get `patterns` (exact file names or globs; none: the whole repo) into the cache."""
    cmd = ["hf", "download", ctx.repo_id]
    patterns = patterns or []
    if any(c in p for p in patterns for c in "*?["):  # `hf download` takes file names or --include globs, not both
        for p in patterns:
            cmd += ["--include", _quote(p)]
    else:
        cmd += [_quote(p) for p in patterns]
    if ctx.revision:
        cmd += ["--revision", _quote(ctx.revision)]
    return (f"To fetch them, run again with network access and HF_HUB_OFFLINE unset (or HF_HUB_OFFLINE=0), or run "
            f"`{' '.join(cmd)}` (formerly `huggingface-cli download`) with the same HF_HOME / HF_HUB_CACHE "
            f"(the cache is {_cache_dir()}).")


def _missing_message(ctx: _Ctx, folder: str, missing: list[str], reason: str) -> str:
    globs = {"*.safetensors weights": "*.safetensors", _TOKENIZER_DESC: "tokenizer*"}
    return (f"model: the cached snapshot of the Hugging Face repo {ctx.repo_id!r} (revision {ctx.rev}, commit "
            f"{Path(folder).name}) at {folder} is missing {', '.join(missing)}. {reason} "
            + _fetch_hint(ctx, [globs.get(f, f) for f in missing]))


def _quote(s: str) -> str:
    return s if re.fullmatch(r"[\w./:=+-]+", s) else "'" + s.replace("'", "'\\''") + "'"


def _short(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")
