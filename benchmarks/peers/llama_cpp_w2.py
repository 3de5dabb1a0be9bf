"""W2 (single stream: 32 prompt tokens, 256 output tokens, greedy, EOS ignored) on llama.cpp, through
llama-cpp-python, with the bundled model's weights converted to BF16 (or any GGUF given).

Not part of pagedserve: a peer measurement for benchmarks/README.md. It needs llama-cpp-python, which is
not a pagedserve dependency (it builds llama.cpp from source, ~10 min on 2 cores), in its own venv:

    python3 -m venv /tmp/lcpvenv && CMAKE_ARGS=-DGGML_NATIVE=ON /tmp/lcpvenv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python -c "import json; from pagedserve.entrypoints.cli.bench import random_prompts; \\
        print(json.dumps(random_prompts(1, 32, 0)[0]))" > /tmp/w2_prompt.json
    /tmp/lcpvenv/bin/python benchmarks/peers/llama_cpp_w2.py --src BUNDLED.gguf --prompt /tmp/w2_prompt.json \\
        --json benchmarks/peers/llama_cpp_w2_bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import llama_cpp


def convert(src: str, dst: str, ftype: int) -> None:
    """Re-encode every tensor of `src` (e.g. the bundled Q4_1 file) as `ftype` (BF16) with llama.cpp."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = ftype
    params.allow_requantize = True
    params.pure = True  # every tensor in ftype, embeddings and output included
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True, help="source GGUF")
    ap.add_argument("--prompt", required=True, help="JSON list of prompt token ids")
    ap.add_argument("--out-gguf", default="/tmp/smollm2-135m-bf16.gguf")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not os.path.exists(args.out_gguf):
        convert(args.src, args.out_gguf, llama_cpp.LLAMA_FTYPE_MOSTLY_BF16)
    prompt = json.load(open(args.prompt))
    llm = llama_cpp.Llama(args.out_gguf, n_ctx=512, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    ttfts, tpots = [], []
    for it in range(args.num_iters + 1):  # the first run warms up
        llm.reset()
        start = time.perf_counter()
        first = None
        n = 0
        for _tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == args.output_len:
                break
        end = time.perf_counter()
        if it:
            ttfts.append(first - start)
            tpots.append((end - first) / (n - 1))
    result = {
        "mode": "latency", "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        "weights": os.path.basename(args.out_gguf), "threads": args.threads, "input_len": len(prompt),
        "output_len": args.output_len, "num_iters": args.num_iters,
        "ttft_s_mean": statistics.mean(ttfts), "tpot_s_mean": statistics.mean(tpots),
        "decode_tokens_per_s": 1.0 / statistics.mean(tpots),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
