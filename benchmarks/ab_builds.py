"""W1, W2 or W3 on two builds of the C++ extension in ONE process, alternating, so that a noisy host's drift falls on
both alike (these machines vary by up to 1.7x within minutes).

    python benchmarks/ab_builds.py A.so B.so --workload W2 --reps 6 [--input-len 32] [--model M]
                                   [--a-config KEY=VALUE ...] [--b-config KEY=VALUE ...]

A.so / B.so: extension builds, e.g. ~/.cache/torch_extensions/py311_cpu/pagedserve_cpu_<hash>/pagedserve_cpu_<hash>.so
of two commits (an older commit's build: `git worktree add /tmp/old <commit>` and import pagedserve from there once).
Each build gets its own engine (same model, same random prompts); W1 is 128 prompts of 128 ids, 128 out; W2 one
request of 32 ids, 256 out, averaged over its decode steps; W3 16 prompts of 1,024 ids, 1 out (prompt tok/s). Prints
both figures per repetition and the medians. --a-config / --b-config set EngineConfig fields of one engine only
(e.g. the same build twice with --b-config huge_pages=false: a config switch A/B in one process).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import pagedserve.kernels as kernels
from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.engine import LLMEngine
from pagedserve.entrypoints.cli.bench import random_prompts


def load_build(path: str):
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    args = ap.parse_args()
    engines = []
    for path, overrides in ((args.a, args.a_config), (args.b, args.b_config)):
        build = load_build(path)
        kernels.load_extension = lambda arch="native", build=build: build  # what CpuKernels.build loads
        fields = {"model": args.model} if args.model else {}
        fields.update(config_value(item) for item in overrides)
        engines.append(LLMEngine(EngineConfig(dtype="auto", **fields)))
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
