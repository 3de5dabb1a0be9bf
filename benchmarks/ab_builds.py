"""W1, W2 or W3 on two builds of the C++ extension in ONE process, alternating, so that a noisy host's drift falls on
both alike (these machines vary by up to 1.7x within minutes).

    python benchmarks/ab_builds.py A.so B.so --workload W2 --reps 6 [--input-len 32] [--model M]
                                   [--a-config KEY=VALUE ...] [--b-config KEY=VALUE ...] [--share-weights]

A.so / B.so: extension builds, e.g. ~/.cache/torch_extensions/py311_cpu/pagedserve_cpu_<hash>/pagedserve_cpu_<hash>.so
of two commits (an older commit's build: `git worktree add /tmp/old <commit>` and import pagedserve from there once).
Each build gets its own engine (same model, same random prompts); W1 is 128 prompts of 128 ids, 128 out; W2 one
request of 32 ids, 256 out, averaged over its decode steps; W3 16 prompts of 1,024 ids, 1 out (prompt tok/s). Prints
both figures per repetition and the medians. --a-config / --b-config set EngineConfig fields of one engine only
(e.g. the same build twice with --b-config huge_pages=false: a config switch A/B in one process).

--share-weights: engine B reads engine A's packed GGUF blocks (the same memory) instead of packing its own copy, after
checking that its own packing of each weight gives the same bytes (else it stops: the builds' layouts differ). Each
engine's own copy puts the weights in different pages, and where a step is bound by reading them (the LM head, a W2
step on a CPU whose GEMV keeps up with memory) that placement alone moved a kernel 0.97-1.15x on a Zen 3 (thirty-third
part of benchmarks/README.md); with one copy the same build read 0.99-1.01x. Only GGUF blocks read in place are shared
(a safetensors model's weights stay per engine).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import statistics
import time
from pathlib import Path

import torch

import pagedserve.kernels as kernels
from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.cli.bench import random_prompts
from pagedserve.kernels import CpuKernels


def load_build(path: str):
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SharedWeights:
    """--share-weights: CpuKernels.quant_pack / resident wrapped so that the second engine built gets the first one's
    resident packed weights, matched by the raw blocks' contents (type, shape, hash)."""

    def __init__(self) -> None:
        self.recording = True  # building engine A; False: engine B
        self.placed: dict[tuple, list] = {}  # content key -> A's resident packed weight
        self.pending: dict[int, tuple] = {}  # id(packed) -> (key, packed): A's packs until `resident` places them
        self.handed: dict[int, list] = {}  # id -> A's packed weights handed to B (resident keeps them as they are)
        self.own = 0  # B's weights with no packed copy of A's to share (packed only to be widened, say)

    def install(self) -> None:
        pack, resident = CpuKernels.quant_pack, CpuKernels.resident

        def quant_pack(kern: CpuKernels, raw, type_id: int):
            packed = pack(kern, raw, type_id)
            key = (type_id, tuple(raw.shape), hashlib.blake2b(raw.contiguous().numpy(), digest_size=16).digest())
            if self.recording:
                self.pending[id(packed)] = (key, packed)
                return packed
            theirs = self.placed.get(key)
            if theirs is None:
                self.own += 1
                return packed
            if len(theirs) != len(packed) or not all(torch.equal(a, b) for a, b in zip(theirs, packed, strict=True)):
                raise SystemExit("--share-weights: build B packs a weight into other bytes than build A (another "
                                 "layout): run without --share-weights")
            self.handed[id(theirs)] = theirs
            return theirs

        def resident_(kern: CpuKernels, packed):
            if id(packed) in self.handed:
                return packed
            out = resident(kern, packed)
            entry = self.pending.pop(id(packed), None)
            if entry is not None:
                self.placed[entry[0]] = out
            return out

        CpuKernels.quant_pack = quant_pack
        CpuKernels.resident = resident_

    def summary(self) -> str:
        nbytes = sum(t.numel() * t.element_size() for packed in self.handed.values() for t in packed)
        return (f"--share-weights: B reads A's packed weights ({len(self.handed)} tensors, {nbytes / 2**20:.1f} MiB); "
                f"{self.own} packed by B alone")


def run_w1(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    for j, p in enumerate(prompts):
        engine.add_request(f"{tag}-{j}", {"prompt_token_ids": p}, params)
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * 128 / (time.perf_counter() - t)


def run_w3(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    engine.reset_prefix_cache()
    for j, p in enumerate(prompts):
        engine.add_request(f"{tag}-{j}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=1))
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return sum(len(p) for p in prompts) / (time.perf_counter() - t)


def run_w2(engine: LLMEngine, prompt: list[int], tag: str) -> float:
    engine.reset_prefix_cache()
    engine.add_request(tag, {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, ignore_eos=True, max_tokens=256))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    budget = engine.config.max_num_batched_tokens
    prefill = -(-len(prompt) // budget)  # decode steps only (a long prompt's prefill takes several chunks)
    return (len(times) - prefill) / sum(times[prefill:])


def config_value(item: str) -> tuple[str, object]:
    """KEY=VALUE -> (key, value): true/false, an int, a float, else the string."""
    key, _, text = item.partition("=")
    for parse in (int, float):
        try:
            return key, parse(text)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(text.lower(), text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--workload", choices=("W1", "W2", "W3"), default="W2")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--input-len", type=int, default=32,
                    help="W2's prompt length (e.g. 6144: decode at a long context)")
    ap.add_argument("--a-config", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--b-config", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--share-weights", action="store_true",
                    help="engine B reads engine A's packed GGUF weights (one copy: no page placement difference)")
    args = ap.parse_args()
    shared = SharedWeights() if args.share_weights else None
    if shared is not None:
        shared.install()
    engines = []
    for path, overrides in ((args.a, args.a_config), (args.b, args.b_config)):
        build = load_build(path)
        kernels.load_extension = lambda arch="native", build=build: build  # what CpuKernels.build loads
        fields = {"dtype": "auto", **({"model": args.model} if args.model else {})}
        fields.update(config_value(item) for item in overrides)  # (dtype=float32: another route)
        engines.append(LLMEngine(EngineConfig(**fields)))
        if shared is not None:
            shared.recording = False
    if shared is not None:
        print(shared.summary(), flush=True)
    figures: list[list[float]] = [[], []]
    unit = {"W1": "output tok/s", "W2": "decode tok/s", "W3": "prompt tok/s"}[args.workload]
    for rep in range(args.reps):
        for i, engine in enumerate(engines):
            if args.workload == "W1":
                figures[i].append(run_w1(engine, random_prompts(128, 128, 0), f"r{rep}"))
            elif args.workload == "W3":
                figures[i].append(run_w3(engine, random_prompts(16, 1024, 0), f"r{rep}"))
            else:
                figures[i].append(run_w2(engine, random_prompts(1, args.input_len, rep)[0], f"r{rep}"))
        print(f"rep {rep}: A {figures[0][-1]:.1f}  B {figures[1][-1]:.1f} {unit}", flush=True)
    a, b = statistics.median(figures[0]), statistics.median(figures[1])
    print(f"{args.workload} median: A {a:.1f}  B {b:.1f} {unit}  B/A {b / a:.3f}")


if __name__ == "__main__":
    main()
