"""Would a screened greedy head find the same argmax with few exact logits? (an offline experiment, no engine change)

Runs W1-like greedy decoding (64 prompts of 128 random token ids, 24 tokens each), keeps the LM head's inputs of the
last steps (the rows `MatmulRoutes.argmax` receives), and for each row compares:
  - the reference logits: x (bf16) times the head's weights as the reference has them (Q8_0 blocks dequantized and
    rounded to bf16), summed in float64;
  - a screen in the int8 route's numerics: x quantized to int8 per 32-block (scale max|x| / 127), integer dot
    products with the file's Q8_0 quants, times both scales;
  - a rigorous bound on their difference per logit: per block, sum |d q| times max|x| times 2^-8 (each bf16 weight is
    within 2^-8 |d q| of d q, bf16 having 8 significant bits), plus half an int8 step of x, plus 2 K 2^-24 (the
    float32 sums of either side, each within K 2^-24 of the sum of its terms' magnitudes), times 1.01.
The candidates of a row are the columns whose screened logit plus its bound reaches the largest screened logit minus
its bound: the exact argmax is always among them (checked), and only they would need the exact bf16 chain. Prints
how many there are per row.

    python benchmarks/head_screen.py [--model GGUF]   # default: the bundled model; its head must be Q8_0
"""

from __future__ import annotations

import argparse
import random

import gguf
import numpy as np
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.model.loader import bundled_model_path
from pagedserve.model.matmul import MatmulRoutes


def head_rows(llm: LLM, steps: int) -> torch.Tensor:
    rows = []
    argmax = MatmulRoutes.argmax

    def grab(self, x, bias=None):
        rows.append(x.detach().to(torch.bfloat16).clone())
        return argmax(self, x, bias)

    MatmulRoutes.argmax = grab
    try:
        rng = random.Random(0)
        vocab = llm.engine.runner.model.config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(128)]} for _ in range(64)]
        llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        MatmulRoutes.argmax = argmax
    if not rows:
        raise SystemExit("the head's argmax path was not taken (it needs the bf16 GGUF head: AVX512-BF16)")
    return torch.cat(rows[-steps:]).float()


def q8_0_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's Q8_0 blocks as (d [N, blocks], q [N, blocks, 32])."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    t = tensors.get("output.weight") or tensors["token_embd.weight"]
    if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        raise SystemExit(f"the head is {t.tensor_type.name}, not Q8_0")
    raw = np.asarray(t.data).reshape(-1, 34)
    n = int(t.shape[1])
    d = torch.from_numpy(raw[:, :2].copy().view(np.float16).astype(np.float32)).reshape(n, -1)
    q = torch.from_numpy(raw[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(n, d.shape[1], 32)
    return d, q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=3, help="the last steps' rows to check")
    args = ap.parse_args()
    llm = LLM(model=args.model)
    x = head_rows(llm, args.steps).double()
    d, q = q8_0_head(args.model or bundled_model_path())
    n, nb = d.shape
    xb = x.reshape(x.shape[0], nb, 32)
    xmax = xb.abs().amax(2)
    sx = xmax / 127
    xq = torch.round(xb / sx[:, :, None].clamp_min(1e-30))
    k = x.shape[1]
    coef = (2.0**-8 + 2 * k * 2.0**-24 * (1 + 2.0**-8)) * xmax + sx / 2  # times sum |d q| per block
    exact, screened, bound = [], [], []
    for n0 in range(0, n, 8192):  # in column chunks (Gemma 3's 262,144 columns)
        dd, qq = d[n0 : n0 + 8192].double(), q[n0 : n0 + 8192].double()
        w = (dd[:, :, None] * qq).reshape(dd.shape[0], -1).to(torch.bfloat16).double()
        exact.append(x @ w.T)
        screened.append((torch.einsum("rbk,nbk->rnb", xq, qq) * (dd[None] * sx[:, None, :])).sum(2))
        bound.append(coef @ (dd.abs() * qq.abs().sum(2)).T)
    exact, screened = torch.cat(exact, 1), torch.cat(screened, 1)
    bound = torch.cat(bound, 1) * 1.01
    best = exact.argmax(1)
    cand = screened + bound >= (screened - bound).amax(1, keepdim=True)
    count = cand.sum(1).double()
    top2 = exact.topk(2, dim=1).values
    print(f"vocabulary {n}, {x.shape[0]} rows: exact argmax among the candidates in every row: "
          f"{bool(cand.gather(1, best[:, None]).all())}")
    print(f"candidates per row: median {count.median():.0f}, 90th percentile {count.quantile(0.9):.0f}, "
          f"max {count.max():.0f}; bound median {bound.median():.3f}, logit std {exact.std():.3f}, "
          f"top-2 gap median {(top2[:, 0] - top2[:, 1]).median():.3f}")


if __name__ == "__main__":
    main()
