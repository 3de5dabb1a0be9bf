"""Where a standard workload's wall time goes, step by step: the engine's steps wrapped in timers (low overhead:
perf_counter_ns around a handful of calls, no profiler), then per kind of step (prefill / mixed, pure decode) the
mean time of the step, of the model's forward, of its C++ decode stack and LM head, and of the Python around them.

    python benchmarks/step_times.py [--workload W1|W2|W3] [--int8-activations] [--dtype auto] [--model M] [--reps 1]
                                    [--input-len N] [--output-len N] [--num-scheduler-steps 1]

(An AVX2-only CPU emulated: PAGEDSERVE_CPU_ARCH=x86-64-v3 ... --dtype float32.)

W1: 128 prompts of 128 random token ids, 128 tokens each (one generate); W2: one 32-token prompt, 256 tokens;
W3: 16 prompts of 1,024, one token each. Greedy, ignore_eos, after a warm-up request, as `pagedserve bench`.
Decode steps run one at a time by default (--num-scheduler-steps 1), so that each is timed alone; with N > 1 (as
`LLM.generate` runs them: 8) a "decode step" is a run of up to N steps, and its C++ stack time is the whole run
(`greedy_steps`: the embedding, the stack and the head of every step).
"""

from __future__ import annotations

import argparse
import time
import types
from collections import defaultdict

from pagedserve.entrypoints.cli.bench import random_prompts
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("W1", "W2", "W3"), default="W1")
    ap.add_argument("--int8-activations", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=None, help="the workload's prompt length instead (e.g. W2 at a "
                    "long context)")
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--num-scheduler-steps", type=int, default=1)
    args = ap.parse_args()
    num, input_len, output_len = {"W1": (128, 128, 128), "W2": (1, 32, 256), "W3": (16, 1024, 1)}[args.workload]
    input_len = args.input_len or input_len
    output_len = args.output_len or output_len
    llm = LLM(model=args.model, int8_activations=args.int8_activations, dtype=args.dtype,
              num_scheduler_steps=args.num_scheduler_steps)
    eng = llm.engine
    cur: dict[str, int] = defaultdict(int)

    def timer(fn, key: str):
        """fn, its time added to cur[key] at every call."""
        def call(*a, **k):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                cur[key] += time.perf_counter_ns() - t

        return call

    for obj, name in ((eng.scheduler, "schedule"), (eng.scheduler, "update"), (eng.runner, "prepare_inputs"),
                      (eng.runner, "forward"), (eng.runner, "sample")):
        setattr(obj, name, timer(getattr(obj, name), name))
    prepare = eng.runner.prepare_inputs

    def counted_prepare(out):  # a decode step schedules one token per sequence
        cur["decode"] = int(all(len(s.token_ids) == 1 for s in out.scheduled))
        return prepare(out)

    eng.runner.prepare_inputs = counted_prepare
    model = eng.runner.model
    # The C++ DecodeStack's one call per decode step, and the LM head's matmul called from Python after it.
    stack = model._decode_stack(eng.runner.kv_caches, eng.runner.backend.row_invariant)
    timed_stack = types.SimpleNamespace(forward=timer(stack.forward, "stack"),
                                        greedy_steps=timer(stack.greedy_steps, "stack"))
    model._decode_stack = lambda *a, **k: timed_stack

    class TimedHead:
        """The head's routes, both ways in timed: the logits (a call) and a greedy step's argmaxes (argmax)."""

        def __init__(self, routes) -> None:
            self.routes, self.call, self.argmax = routes, timer(routes, "head"), timer(routes.argmax, "head")

        def __call__(self, *a, **k):
            return self.call(*a, **k)

        def __getattr__(self, name: str):
            return getattr(self.routes, name)

    if model.lm_head is not None:
        model.lm_head.routes = TimedHead(model.lm_head.routes)
    else:
        model.tied_head_routes = TimedHead(model.tied_head_routes)

    steps: list[tuple[bool, int, dict[str, int]]] = []
    step = eng.step

    def timed_step():
        cur.clear()
        t = time.perf_counter_ns()
        out = step()
        steps.append((not cur.get("decode", 0), time.perf_counter_ns() - t, dict(cur)))
        return out

    eng.step = timed_step
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(num, input_len, 0)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    for _ in range(args.reps):
        eng.reset_prefix_cache()
        steps.clear()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        print(f"{args.workload}{' --int8-activations' if args.int8_activations else ''}: {elapsed:.2f} s, "
              f"{num * output_len / elapsed:.1f} output tok/s, {num * input_len / elapsed:.1f} prompt tok/s, "
              f"{len(steps)} steps "
              f"({elapsed - sum(s[1] for s in steps) / 1e9:.3f} s outside them)")
        for kind, group in (("prefill / mixed", [s for s in steps if s[0]]),
                            ("decode", [s for s in steps if not s[0]])):
            if not group:
                continue
            n = len(group)

            def mean(key: str, group=group, n=n) -> float:
                return sum(s[2].get(key, 0) for s in group) / n / 1e3

            step_us = sum(s[1] for s in group) / n / 1e3
            fwd = mean("forward")
            parts = " ".join(f"{k} {mean(k):.0f}" for k in ("schedule", "prepare_inputs", "sample", "update"))
            print(f"  {kind}: {n} steps, {step_us:.0f} us/step: forward {fwd:.0f} (C++ stack {mean('stack'):.0f}, "
                  f"head {mean('head'):.0f}, the rest {fwd - mean('stack') - mean('head'):.0f}); outside the forward "
                  f"{step_us - fwd:.0f} ({parts})")


if __name__ == "__main__":
    main()
