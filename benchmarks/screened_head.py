"""The bf16 greedy head with and without its int8 screen, on the rows a W1 run hands it.

Runs W1 (128 prompts of 128 random token ids, greedy, 128 tokens each; one decode step at a time) and keeps the LM
head's inputs of every 128-row step, then times `quant_linear_bf16_argmax` on each of them exactly (every column's
bf16 chain, the many-rows kernels) and screened (`quant_screen_i8_norms`: the int8 VNNI screen, then the exact chains
of the panels that can hold a row's maximum), checks that both give the same indices, and prints the medians per
step: the first steps after random prompts (flat logits: the most candidates) and later ones.

    python benchmarks/screened_head.py [--model GGUF] [--reps 5]   # default: the bundled model (a Q8_0 head)

With --generate N, instead: N rounds of W1 through `LLM.generate` (multi-step decoding, prefix caching off), one
with the screen and one without in each (the same engine: the head's screen set aside), and their output tok/s and
whether their tokens are the same.

Needs an AVX512-BF16 + VNNI build (the screen's condition) and a Q8_0 head read in place.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.cli.bench import random_prompts
from pagedserve.model.matmul import MatmulRoutes


def head_inputs(llm: LLM, rows: int) -> list[torch.Tensor]:
    """The head's inputs of every step of `rows` rows in a W1 run."""
    got = []
    argmax = MatmulRoutes.argmax

    def grab(self, x, bias=None):
        if x.shape[0] == rows:
            got.append(x.detach().to(torch.bfloat16).clone())
        return argmax(self, x, bias)

    MatmulRoutes.argmax = grab
    try:
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in random_prompts(rows, 128, 5)], params, use_tqdm=False)
    finally:
        MatmulRoutes.argmax = argmax
    return got


def generate_ab(llm: LLM, head: MatmulRoutes, rounds: int) -> None:
    """W1 through LLM.generate with and without the head's screen, alternating."""
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(128, 128, 0)]
    llm.generate(prompts[:4], params, use_tqdm=False)
    screen, tokens, ratios = head.screen_i8, {}, []
    for r in range(rounds):
        rate = {}
        for name, sc in (("screened", screen), ("exact", None)):
            head.screen_i8 = sc
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rate[name] = 128 * 128 / (time.perf_counter() - t)
            tokens.setdefault(name, [o.outputs[0].token_ids for o in outs])
        head.screen_i8 = screen
        ratios.append(rate["screened"] / rate["exact"])
        print(f"round {r}: screened {rate['screened']:.1f} tok/s, exact {rate['exact']:.1f} ({ratios[-1]:.3f}x)")
    print(f"median {statistics.median(ratios):.3f}x; the same tokens: {tokens['screened'] == tokens['exact']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--generate", type=int, default=0, metavar="N")
    args = ap.parse_args()
    llm = LLM(model=args.model, num_scheduler_steps=None if args.generate else 1, enable_prefix_caching=False)
    head = llm.engine.runner.model._head_routes
    if head.screen_i8 is None:
        raise SystemExit("no screened head here (it needs an AVX512-BF16 + VNNI build and a Q8_0 head)")
    if args.generate:
        generate_ab(llm, head, args.generate)
        return
    p, k = head.quant[0], head.kernels
    xs = head_inputs(llm, 128)

    def timed(x, screen):
        ts, out = [], None
        for _ in range(args.reps):
            t = time.perf_counter()
            out = k.quant_linear_bf16_argmax(x, p.packed, p.type_id, p.n, None, screen)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3, out

    print(f"{len(xs)} steps of 128 rows; head {p.n} x {xs[0].shape[1]}, ms per call (median of {args.reps})")
    exact_all, screen_all = [], []
    for i, x in enumerate(xs):
        te, a = timed(x, None)
        ts, b = timed(x, head.screen_i8)
        assert torch.equal(a, b), f"step {i}: the screened head's indices differ"
        exact_all.append(te)
        screen_all.append(ts)
        if i < 8 or i % 20 == 0:
            print(f"step {i:3d}: exact {te:6.2f}  screened {ts:6.2f}  ({te / ts:.2f}x)")
    e, s = sum(exact_all), sum(screen_all)
    print(f"all steps: exact {e:.0f} ms, screened {s:.0f} ms ({e / s:.2f}x); the same indices on every row")


if __name__ == "__main__":
    main()
