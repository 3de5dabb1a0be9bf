"""`pagedserve bench throughput|latency|serve`, modelled on `vllm bench`.

Every mode prints a summary and can write it with --json. Prompts are random token ids from a seed
(uniform in [1000, 20000), as the standard workloads use) or the lines of a prompts file.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from pagedserve.config import MODEL_DTYPES
from pagedserve.entrypoints.cli.args import add_engine_args, engine_config_from_args
from pagedserve.entrypoints.cli.roofline import add_roofline
from pagedserve.kernels import cpu_info


def random_prompts(num: int, input_len: int, seed: int, low: int = 1000, high: int = 20000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (num, input_len), generator=g).tolist()


def int8_activations_used(engine) -> bool:
    """Whether this engine's decode matmuls quantize activations to int8 (--int8-activations, where the CPU can)."""
    kernels = getattr(getattr(engine, "runner", None), "kernels", None)
    return bool(kernels is not None and kernels.quant_i8)


def machine_info(device: str | None = None) -> dict:
    """The CPU, and with device="cuda" the GPU too (its name, CUDA and Triton versions)."""
    info = cpu_info()
    out = {"cpu": info.model_name, "cpu_flags": info.speed_flags, "cores": len(os.sched_getaffinity(0)),
           "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    if device is not None:
        out["device"] = device
    if device == "cuda" and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_count"] = torch.cuda.device_count()
        out["cuda"] = torch.version.cuda
        try:
            import triton

            out["triton"] = triton.__version__
        except ImportError:
            pass
    return out


def _sync(device: str) -> None:
    """Wait for the device's queued work, so a host clock read after it times that work (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _load_prompts(args, seed: int) -> list:
    if getattr(args, "prompts_file", None):
        lines = [ln for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip()]
        return lines[: args.num_prompts] if args.num_prompts else lines
    prompts = random_prompts(args.num_prompts, args.input_len, seed)
    shared = getattr(args, "shared_prefix_len", 0) or 0
    if shared:  # the first `shared` tokens are the same for every prompt (a system prompt, few-shot)
        prompts = [prompts[0][:shared] + p[shared:] for p in prompts]
    return prompts


def _write_json(args, result: dict) -> None:
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


# ---- throughput ----------------------------------------------------------------------------------
def run_throughput(args, config) -> dict:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(**{k: v for k, v in vars(config).items() if k != "model"}, model=config.model)
    prompts = _load_prompts(args, config.seed)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            ignore_eos=True, max_tokens=args.output_len)
    warm = {"prompt_token_ids": random_prompts(1, 16, config.seed + 1)[0]}
    llm.generate([warm], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    llm.engine.reset_prefix_cache()
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    after = llm.engine.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    result = {
        "mode": "throughput", "engine": "pagedserve", "model": llm.engine.served_model_name,
        "dtype": str(llm.engine.dtype).removeprefix("torch."), "int8_activations": int8_activations_used(llm.engine),
        "num_scheduler_steps": llm.num_scheduler_steps, "num_prompts": len(outs),
        "input_len": args.input_len, "output_len": args.output_len, "elapsed_s": elapsed,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p},
        "requests_per_s": len(outs) / elapsed, "output_tokens_per_s": output_tokens / elapsed,
        "prompt_tokens_per_s": prompt_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "ttft_s_mean": statistics.mean(ttfts), "ttft_s_p50": statistics.median(ttfts),
        "shared_prefix_len": args.shared_prefix_len,
        "enable_prefix_caching": llm.engine.config.enable_prefix_caching,
        "computed_prefill_tokens": after.num_computed_prefill_tokens - before.num_computed_prefill_tokens,
        "prefix_cache_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "machine": machine_info(llm.engine.config.device),
    }
    if args.compare_hf:
        hf = run_hf_generate(llm.engine.model_path, _hf_dtype(args, llm.engine.dtype), prompts, args.output_len,
                             device=llm.engine.config.device)
        result["hf"] = hf
        result["output_tokens_per_s_ratio_vs_hf"] = result["output_tokens_per_s"] / hf["output_tokens_per_s"]
    if not args.prompts_file:  # the roofline's FLOP count needs the prompts' length
        add_roofline(result, llm.engine, "throughput", len(outs), args.input_len, args.output_len)
    return result


# The schema of `bench throughput --structured json`: nested objects, an enum, arrays and required fields
# (what applications ask of a model), with bounds so an answer fits in --output-len tokens.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "doctor", "teacher", "artist", "other"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "country": {"type": "string", "maxLength": 30}},
                    "required": ["city", "country"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 5},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}


def run_structured(args, config) -> dict:
    """Every request under one JSON schema, then the same prompts unconstrained, each request generating
    exactly as many tokens as it did under the schema (ignore_eos): the same work but for the masks, so
    the ratio of output tok/s is what structured outputs cost. Both runs start with a cold prefix cache."""
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured_output.params import StructuredOutputsParams

    llm = LLM(**{k: v for k, v in vars(config).items() if k != "model"}, model=config.model)
    engine = llm.engine
    schema = json.loads(Path(args.schema).read_text()) if args.schema else BENCH_SCHEMA
    # Compact JSON by default: with free whitespace, random-token prompts make the small model pad every
    # token with newlines, which measures nothing but whitespace.
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=not args.flexible_whitespace)
    prompts = _load_prompts(args, config.seed)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    warm = {"prompt_token_ids": random_prompts(1, 16, config.seed + 1)[0]}
    llm.generate([warm], SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec), use_tqdm=False)
    engine.reset_prefix_cache()

    def timed(params) -> tuple[list, float, list]:
        first = engine.step_count
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=not args.quiet)
        elapsed = time.perf_counter() - start
        engine.reset_prefix_cache()
        return outs, elapsed, [r for r in engine.step_records if r.step >= first]

    constrained, t_c, steps_c = timed(SamplingParams(temperature=0, max_tokens=args.output_len,
                                                     structured_outputs=spec))
    lengths = [len(o.outputs[0].token_ids) for o in constrained]
    plain, t_p, steps_p = timed([SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in lengths])
    assert [len(o.outputs[0].token_ids) for o in plain] == lengths
    tokens = sum(lengths)
    valid = 0
    for o in constrained:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    masked = [r for r in steps_c if r.num_constrained]
    mask_s = sum(r.mask_s for r in masked)
    wait_s = sum(r.mask_wait_s for r in masked)
    step_s = sum(r.duration_s for r in steps_c)
    return {
        "mode": "throughput", "structured": "json", "engine": "pagedserve", "model": engine.served_model_name,
        "dtype": str(engine.dtype).removeprefix("torch."), "num_prompts": len(inputs), "input_len": args.input_len,
        "output_len": args.output_len, "output_tokens": tokens,
        "finished_by_grammar": sum(o.outputs[0].finish_reason == "stop" for o in constrained),
        "valid_json": valid, "flexible_whitespace": args.flexible_whitespace,
        "example_output": constrained[0].outputs[0].text[:400],
        "structured_elapsed_s": t_c, "structured_output_tokens_per_s": tokens / t_c,
        "plain_elapsed_s": t_p, "plain_output_tokens_per_s": tokens / t_p,
        "structured_vs_plain": t_p / t_c,
        "steps": len(steps_c), "plain_steps": len(steps_p),
        "mask_ms_per_step": 1e3 * mask_s / max(len(masked), 1),
        "mask_wait_ms_per_step": 1e3 * wait_s / max(len(masked), 1),
        "mask_share_of_step_time": mask_s / step_s if step_s else 0.0,
        "mask_wait_share_of_step_time": wait_s / step_s if step_s else 0.0,
        "machine": machine_info(engine.config.device),
    }


def run_hf_generate(model_path: str, dtype: torch.dtype, prompts: list, output_len: int,
                    device: str = "cpu") -> dict:
    """HF transformers `generate` as a static batch over the same prompts, same dtype, greedy, on `device`."""
    from transformers import AutoTokenizer

    model = _hf_model(model_path, dtype, device)
    if isinstance(prompts[0], str):
        if os.path.isdir(model_path):
            tok = AutoTokenizer.from_pretrained(model_path)
        else:
            tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
        prompts = [tok.encode(p) for p in prompts]
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError("compare-hf: prompts must have one length (static batch without padding)")
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - start
    new_tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"engine": f"transformers {__import__('transformers').__version__} generate",
            "dtype": str(dtype).removeprefix("torch."), "device": device, "elapsed_s": elapsed,
            "output_tokens_per_s": new_tokens / elapsed,
            "total_tokens_per_s": (new_tokens + ids.numel()) / elapsed}


# ---- latency -------------------------------------------------------------------------------------
def _latency_prompts(args, engine, seed: int) -> list[list[int]]:
    """Random token ids, or a prompts file: JSON lines with "prompt" (text) or "messages" (a chat, through
    the model's chat template), or plain text lines. The first prompt is the warm-up."""
    if not getattr(args, "prompts_file", None):
        return random_prompts(args.num_iters + 1, args.input_len, seed)
    tok = engine.tokenizer
    out = []
    for line in Path(args.prompts_file).read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line) if line.lstrip().startswith("{") else {"prompt": line}
        if "messages" in item:
            out.append(tok.encode(tok.apply_chat_template(item["messages"], True), False))
        else:
            out.append(tok.encode(item["prompt"]))
    if not out:
        raise ValueError(f"prompts_file: {args.prompts_file} has no prompt")
    return [out[0]] + out  # the first prompt twice: once as the warm-up


def _time_one(engine, rid: str, prompt: list[int], params) -> tuple[float, float, int]:
    """(TTFT, end to end, output tokens) of one request alone on the engine."""
    start = time.perf_counter()
    first = None
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            n = len(out.outputs[0].token_ids)
    return first - start, time.perf_counter() - start, n


def run_latency(args, config) -> dict:
    """One request at a time. With --speculative-config and --compare-no-spec, every prompt also runs
    with speculation switched off on the same engine (alternating, so both see the same machine)."""
    from pagedserve.engine.engine import LLMEngine
    from pagedserve.entrypoints.llm import OFFLINE_SCHEDULER_STEPS
    from pagedserve.sampling_params import SamplingParams

    if config.num_scheduler_steps is None:  # as vLLM's latency benchmark: the offline API's engine
        config = replace(config, num_scheduler_steps=OFFLINE_SCHEDULER_STEPS)
    engine = LLMEngine(config)
    prompts = _latency_prompts(args, engine, config.seed)
    params = SamplingParams(temperature=args.temperature, seed=0 if args.temperature else None,
                            ignore_eos=not args.stop_at_eos, max_tokens=args.output_len)
    speculator = engine.speculator
    compare = bool(getattr(args, "compare_no_spec", False)) and speculator is not None
    runs = {"spec": ([], [], [], []), "plain": ([], [], [], [])} if compare else {"run": ([], [], [], [])}
    for i, prompt in enumerate(prompts):
        for name, (ttfts, tpots, e2es, lens) in runs.items():
            engine.speculator = None if name == "plain" else speculator
            engine.reset_prefix_cache()
            before = speculator.stats.copy() if speculator is not None else None
            ttft, e2e, n = _time_one(engine, f"lat-{name}-{i}", prompt, params)
            if i == 0:
                continue  # warm-up
            ttfts.append(ttft)
            e2es.append(e2e)
            tpots.append((e2e - ttft) / max(n - 1, 1))
            lens.append(n)
            if name == "spec":
                after = speculator.stats
                lens[-1] = (n, after.num_draft_tokens - before.num_draft_tokens,
                            after.num_accepted_tokens - before.num_accepted_tokens)
    engine.speculator = speculator

    def summary(ttfts, tpots, e2es, lens) -> dict:
        # Decode rate over all decode time (tokens after the first / time after the first token).
        decode_tokens = sum((n[0] if isinstance(n, tuple) else n) - 1 for n in lens)
        decode_s = sum(e - t for e, t in zip(e2es, ttfts, strict=True))
        return {"ttft_s_mean": statistics.mean(ttfts), "tpot_s_mean": statistics.mean(tpots),
                "e2e_s_mean": statistics.mean(e2es), "decode_tokens_per_s": decode_tokens / decode_s,
                "prompt_tokens_per_s": statistics.mean(len(p) for p in prompts[1:]) / statistics.mean(ttfts),
                "output_tokens": [n[0] if isinstance(n, tuple) else n for n in lens]}

    result = {
        "mode": "latency", "engine": "pagedserve", "model": engine.served_model_name,
        "dtype": str(engine.dtype).removeprefix("torch."), "int8_activations": int8_activations_used(engine),
        "num_scheduler_steps": engine.num_scheduler_steps,
        "input_len": args.input_len, "output_len": args.output_len, "num_iters": len(prompts) - 1,
        "temperature": args.temperature,
        "prompts_file": getattr(args, "prompts_file", None),
        "speculative_config": engine.speculative_config.to_dict() if engine.speculative_config else None,
        "machine": machine_info(engine.config.device),
    }
    if compare:
        spec, plain = summary(*runs["spec"]), summary(*runs["plain"])
        result.update(spec)
        drafted = sum(n[1] for n in runs["spec"][3])
        accepted = sum(n[2] for n in runs["spec"][3])
        result["spec"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                          "acceptance_rate": accepted / drafted if drafted else 0.0}
        result["no_spec"] = plain
        result["decode_tokens_per_s_ratio_vs_no_spec"] = spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        if not args.temperature:
            assert spec["output_tokens"] == plain["output_tokens"]
    else:
        result.update(summary(*runs["run"]))
    if args.compare_hf:
        hf = run_hf_latency(engine.model_path, _hf_dtype(args, engine.dtype), prompts[1:], args.output_len,
                            device=engine.config.device)
        result["hf"] = hf
        result["decode_tokens_per_s_ratio_vs_hf"] = result["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
    if not args.prompts_file and "decode_tokens_per_s" in result:
        add_roofline(result, engine, "latency", 1, args.input_len, args.output_len)
    return result


# ---- roofline ------------------------------------------------------------------------------------
# The standard workloads of benchmarks/README.md: (bench mode, prompts, input length, output length).
STANDARD_WORKLOADS = {"W1": ("throughput", 128, 128, 128), "W2": ("latency", 1, 32, 256),
                      "W3": ("throughput", 16, 1024, 1)}


def run_roofline(args, config) -> dict:
    """Measure this machine's limits; the standard workloads' limits on this model; and, for each bench
    JSON given, its figure as a share of its limit."""
    from pagedserve.engine.engine import LLMEngine
    from pagedserve.entrypoints.cli import roofline as rl

    engine = LLMEngine(config)
    roof = rl.measure()
    rl.save(roof)
    limits = {name: rl.workload_limit(engine, *w, roof) for name, w in STANDARD_WORKLOADS.items()}
    runs = []
    for path in args.results or []:
        r = json.loads(Path(path).read_text())
        mode = r.get("mode")
        if mode not in ("throughput", "latency"):
            raise ValueError(f"results: {path} is not a `bench throughput` or `bench latency` JSON")
        n = r.get("num_prompts", 1) if mode == "throughput" else 1
        limit = rl.workload_limit(engine, mode, n, r["input_len"], r["output_len"], roof)
        runs.append({"file": path, "mode": mode, "num_prompts": n, "input_len": r["input_len"],
                     "output_len": r["output_len"], **rl.share_of_limit(r, limit),
                     "figure": r.get("decode_tokens_per_s") if mode == "latency" else r.get("output_tokens_per_s")
                     if r["output_len"] > 1 else r.get("prompt_tokens_per_s")})
    if not args.quiet:
        print(f"{roof.cpu} ({', '.join(roof.flags)}), {roof.threads} threads: GEMM "
              + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in roof.gemm_gflops.items())
              + f"; memory read {roof.read_gb_s:.1f} GB/s")
        for name, lim in limits.items():
            if "limit_decode_tokens_per_s" in lim:
                print(f"  {name}: {lim['limit_decode_tokens_per_s']:.0f} decode tok/s at most "
                      f"({lim['bytes_per_token'] / 1e6:.1f} MB read per token)")
            else:
                print(f"  {name}: {lim['limit_output_tokens_per_s']:.0f} output tok/s, "
                      f"{lim['limit_prompt_tokens_per_s']:.0f} prompt tok/s at most ({lim['total_gflop']:.0f} GFLOP)")
        for run in runs:
            print(f"  {run['file']}: {run['figure']:.1f} tok/s = {100 * run['share']:.0f}% of its {run['bound']} limit")
    return {"mode": "roofline", "model": engine.served_model_name, "dtype": str(engine.dtype).removeprefix("torch."),
            "machine": asdict(roof), "workloads": limits, "runs": runs}


def run_hf_latency(model_path: str, dtype: torch.dtype, prompts: list, output_len: int,
                   device: str = "cpu") -> dict:
    """HF transformers `generate`, one prompt at a time on `device`: TTFT (1 new token) and the decode rate."""
    model = _hf_model(model_path, dtype, device)
    ttfts, tpots = [], []
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=2, **kwargs)  # warm-up
        for p in prompts:
            ids = torch.tensor([p], device=device)
            _sync(device)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            _sync(device)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
            _sync(device)
            total = time.perf_counter() - start
            ttfts.append(ttft)
            tpots.append((total - ttft) / max(output_len - 1, 1))
    return {"engine": f"transformers {__import__('transformers').__version__} generate",
            "dtype": str(dtype).removeprefix("torch."), "device": device, "ttft_s_mean": statistics.mean(ttfts),
            "tpot_s_mean": statistics.mean(tpots), "decode_tokens_per_s": 1.0 / statistics.mean(tpots)}


def _hf_dtype(args, engine_dtype: torch.dtype) -> torch.dtype:
    """--hf-dtype: "same" (the engine's dtype) or float32 / bfloat16 (e.g. to compare bf16 against fp32)."""
    from pagedserve.model.loader import resolve_dtype

    choice = getattr(args, "hf_dtype", "same")
    return engine_dtype if choice == "same" else resolve_dtype(choice)


def _hf_model(model_path: str, dtype: torch.dtype, device: str = "cpu"):
    """The HF transformers model, loaded on the CPU (a GGUF is dequantized there) and moved to `device`."""
    from transformers import AutoModelForCausalLM

    if os.path.isdir(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    else:
        d, f = os.path.split(model_path)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    return (model.to(device) if device != "cpu" else model).eval()


# ---- serve ---------------------------------------------------------------------------------------
def _percentiles(values: list[float], name: str) -> dict:
    if not values:
        return {}
    s = sorted(values)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]

    return {f"{name}_mean": statistics.mean(s), f"{name}_p50": pct(50), f"{name}_p90": pct(90),
            f"{name}_p99": pct(99)}


async def _one_stream(client, url: str, body: dict, headers: dict, drop_after: int | None = None) -> dict:
    """One streamed completion; with drop_after, the client goes away after that many text chunks."""
    start = time.perf_counter()
    stamps = []
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}", "status": resp.status_code}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": f"error event: {chunk['error'].get('message', '')[:200]}", "status": "stream-error"}
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
                if drop_after is not None and len(stamps) >= drop_after:
                    return {"dropped": True}  # leaving the block closes the connection mid-stream
    end = time.perf_counter()
    if not stamps:
        return {"error": "no tokens streamed", "status": "empty"}
    return {"ttft": stamps[0] - start, "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "e2e": end - start, "n": len(stamps)}


async def _server_state(client, base_url: str, headers: dict) -> dict:
    """The server's RSS, KV usage and running/waiting requests, read from its /metrics (summed over the
    replicas' `engine` label values with data parallelism; their KV usage averaged)."""
    text = (await client.get(base_url + "/metrics", headers=headers)).text
    wanted = {"process_resident_memory_bytes": "rss_bytes", "pagedserve:kv_cache_usage_perc": "kv_cache_usage",
              "pagedserve:num_requests_running": "num_running", "pagedserve:num_requests_waiting": "num_waiting"}
    state: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted and not line.startswith("#"):
            key = wanted[name]
            state[key] = state.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            counts[key] = counts.get(key, 0) + 1
    if counts.get("kv_cache_usage", 0) > 1:
        state["kv_cache_usage"] /= counts["kv_cache_usage"]
    return state


async def _serve_load(args) -> dict:
    import asyncio
    import random

    import httpx

    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    base = args.base_url.rstrip("/")
    url = base + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    duration = getattr(args, "duration", None)
    abort_fraction = getattr(args, "abort_fraction", 0.0) or 0.0
    model = args.served_model
    async with httpx.AsyncClient(timeout=30) as c:
        if model is None:
            model = (await c.get(base + "/v1/models", headers=headers)).json()["data"][0]["id"]
        state_start = await _server_state(c, base, headers)
    sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed)
    results = []

    async def task(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True}
        drop = rng.randint(1, max(1, args.output_len // 2)) if rng.random() < abort_fraction else None
        async with sem:
            results.append(await _one_stream(client, url, body, headers, drop))

    start = time.perf_counter()
    # httpx pools at most 100 connections by default: past that, streams would queue in the client and the
    # server would see fewer concurrent requests than asked for. No limit here but --max-concurrency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        tasks = []
        i = 0
        # A fixed number of prompts, or (with --duration) new requests until the time is up.
        while (i < len(prompts)) if duration is None else (time.perf_counter() - start < duration):
            if duration is not None:
                while sum(not t.done() for t in tasks) >= (args.max_concurrency or len(prompts)):
                    await asyncio.sleep(0.01)
                    if time.perf_counter() - start >= duration:
                        break
            tasks.append(asyncio.create_task(task(prompts[i % len(prompts)])))
            i += 1
            if args.request_rate and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    async with httpx.AsyncClient(timeout=30) as c:  # let aborted requests drain, then look again
        for _ in range(100):
            state_end = await _server_state(c, base, headers)
            if not state_end.get("num_running") and not state_end.get("num_waiting"):
                break
            await asyncio.sleep(0.1)
    ok = [r for r in results if "n" in r]
    dropped = sum(1 for r in results if r.get("dropped"))
    errors: dict[str, int] = {}
    for r in results:
        if "error" in r:
            errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
    out_tokens = sum(r["n"] for r in ok)
    result = {"mode": "serve", "base_url": args.base_url, "model": model, "num_prompts": len(results),
              "completed": len(ok), "dropped": dropped, "failed": sum(errors.values()), "errors_by_status": errors,
              "input_len": args.input_len, "output_len": args.output_len, "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency, "duration_s": duration, "abort_fraction": abort_fraction,
              "elapsed_s": elapsed, "requests_per_s": len(ok) / elapsed, "output_tokens_per_s": out_tokens / elapsed,
              "server_start": state_start, "server_end": state_end, "machine": machine_info()}
    result.update(_percentiles([r["ttft"] for r in ok], "ttft_s"))
    result.update(_percentiles([(r["e2e"] - r["ttft"]) / max(r["n"] - 1, 1) for r in ok], "tpot_s"))
    result.update(_percentiles([x for r in ok for x in r["itl"]], "itl_s"))
    return result


def run_serve(args) -> dict:
    import asyncio

    return asyncio.run(_serve_load(args))


# ---- CLI -----------------------------------------------------------------------------------------
def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, roofline")
    modes = p.add_subparsers(dest="mode", required=True)
    for mode in ("throughput", "latency", "serve", "roofline"):
        m = modes.add_parser(mode)
        m.add_argument("--input-len", type=int, default=128)
        m.add_argument("--output-len", type=int, default=128)
        m.add_argument("--num-prompts", type=int, default=128 if mode != "latency" else 1)
        m.add_argument("--json", default=None, help="write the result to this file")
        m.add_argument("--quiet", action="store_true")
        if mode == "throughput":
            m.add_argument("--prompts-file", default=None, help="one prompt per line instead of random ids")
            m.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate")
            m.add_argument("--hf-dtype", default="same", choices=["same", *MODEL_DTYPES[1:]],
                           help="dtype of the HF run (default: the engine's)")
            m.add_argument("--shared-prefix-len", type=int, default=0,
                           help="make the first N prompt tokens common to all prompts (prefix caching)")
            m.add_argument("--structured", choices=["json"], default=None,
                           help="every request under one JSON schema, compared with the same work unconstrained")
            m.add_argument("--schema", default=None, help="with --structured json: a JSON schema file "
                           "(default: a nested object with an enum and an array)")
            m.add_argument("--flexible-whitespace", action="store_true",
                           help="with --structured json: allow whitespace between JSON tokens (default: compact)")
            m.add_argument("--temperature", type=float, default=0.0,
                           help="sample every request at this temperature (default 0: greedy, as vLLM's benchmark "
                           "at temperature 0)")
            m.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
            m.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k sampling (0: off)")
            m.add_argument("--min-p", type=float, default=0.0, help="with --temperature: min-p sampling")
        if mode == "latency":
            m.add_argument("--num-iters", type=int, default=3)
            m.add_argument("--prompts-file", default=None, help="JSON lines with \"prompt\" or \"messages\" "
                           "(or plain text lines) instead of random ids; each is timed once")
            m.add_argument("--compare-no-spec", action="store_true", help="with --speculative-config: also run "
                           "every prompt with speculation off on the same engine, and report the ratio")
            m.add_argument("--stop-at-eos", action="store_true", help="end at EOS (default: ignore_eos)")
            m.add_argument("--temperature", type=float, default=0.0, help="sample (seed 0) instead of greedy")
            m.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate")
            m.add_argument("--hf-dtype", default="same", choices=["same", *MODEL_DTYPES[1:]],
                           help="dtype of the HF run (default: the engine's)")
        if mode == "roofline":
            m.add_argument("--results", nargs="*", default=None, metavar="JSON",
                           help="bench throughput / latency JSON files to put against their limits")
        if mode == "serve":
            m.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
            m.add_argument("--base-url", default="http://127.0.0.1:8000")
            m.add_argument("--served-model", default=None)
            m.add_argument("--api-key", default=None)
            m.add_argument("--request-rate", type=float, default=float("inf"))
            m.add_argument("--max-concurrency", type=int, default=None)
            m.add_argument("--duration", type=float, default=None,
                           help="keep sending requests for this many seconds (a soak run) instead of --num-prompts")
            m.add_argument("--abort-fraction", type=float, default=0.0,
                           help="share of streams the client drops part-way (at a random token)")
        else:
            add_engine_args(m)

        def run(args, mode=mode):
            if mode == "serve":
                result = run_serve(args)
            else:
                config = engine_config_from_args(args)
                if mode == "throughput" and args.structured:
                    result = run_structured(args, config)
                elif mode == "roofline":
                    result = run_roofline(args, config)
                else:
                    result = (run_throughput if mode == "throughput" else run_latency)(args, config)
            _write_json(args, result)
            return 0

        m.set_defaults(func=run)
