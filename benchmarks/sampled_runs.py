"""Output tok/s of 128 requests (32 random prompt ids each) under several sampling settings, on one engine.

    PYTHONPATH=TREE python benchmarks/sampled_runs.py bundled|MODEL OUTPUT_LEN '{"temperature":0.8,"top_p":0.95}' ...

Each JSON argument is a SamplingParams' keyword arguments (ignore_eos and max_tokens are added). PYTHONPATH picks
the tree, so two trees can alternate in one session (`pagedserve bench throughput --temperature/--top-p/--top-k`
measures one setting from the command line).
"""

import json
import sys
import time

import pagedserve
from pagedserve.entrypoints.cli.bench import random_prompts
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams


def main() -> None:
    model, out_len, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    llm = LLM(**({} if model == "bundled" else {"model": model}), dtype="bfloat16")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(128, 32, 0)]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    tree = pagedserve.__file__.split("/pagedserve/")[0]
    for spec in runs:
        params = SamplingParams(ignore_eos=True, max_tokens=out_len, **json.loads(spec))
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(tree, spec, f"{n / elapsed:.1f} output tok/s ({elapsed:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
