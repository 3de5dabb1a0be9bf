"""`pagedserve kv`: the block formula with explicit numbers and for the bundled model."""

from __future__ import annotations

import re

from pagedserve.entrypoints.cli.main import main


def test_kv_explicit_numbers(capsys):
    rc = main(["kv", "--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--block-size", "16",
               "--dtype", "float16"])
    out = capsys.readouterr().out
    assert rc == 0
    # 2 × 32 × 32 × 128 × 16 × 2 bytes
    assert "= 8388608 bytes (8 MiB) per block" in out
    assert "512 KiB per token" in out


def test_kv_bundled_model_memory(capsys, bundled_path):
    rc = main(["kv", "--memory-gb", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    # SmolLM2-135M: 30 layers × 3 kv heads × 64 head_dim, 8192-token context
    assert "2 × 30 layers × 3 kv_heads × 64 head_dim × 16 block_size × 2 bytes" in out
    block = 2 * 30 * 3 * 64 * 16 * 2
    assert f"= {block} bytes" in out
    m = re.search(r"1 GiB holds (\d+) blocks = (\d+) tokens", out)
    assert m, out
    blocks, tokens = int(m[1]), int(m[2])
    assert blocks == 1024**3 // block == 2912 and tokens == blocks * 16
    assert f"{blocks // (8192 // 16)} concurrent requests of 8192 tokens" in out


def test_kv_request_len_and_dtype(capsys):
    rc = main(["kv", "--layers", "2", "--kv-heads", "1", "--head-dim", "4", "--block-size", "8",
               "--dtype", "float32", "--memory-gb", "0.5", "--request-len", "20"])
    out = capsys.readouterr().out
    assert rc == 0
    block = 2 * 2 * 1 * 4 * 8 * 4
    blocks = int(0.5 * 1024**3) // block
    assert f"= {block} bytes" in out and f"holds {blocks} blocks = {blocks * 8} tokens" in out
    assert f"{blocks // 3} concurrent requests of 20 tokens" in out


def test_kv_partial_numbers_is_an_error(capsys):
    rc = main(["kv", "--layers", "32"])
    captured = capsys.readouterr()
    assert rc == 2
    assert "error:" in captured.err and "give all three" in captured.err
    assert captured.out == ""


def test_kv_bad_values(capsys):
    assert main(["kv", "--layers", "0", "--kv-heads", "1", "--head-dim", "4"]) == 2
    assert "layers" in capsys.readouterr().err
    assert main(["kv", "--layers", "1", "--kv-heads", "1", "--head-dim", "4", "--dtype", "int3"]) == 2
    assert "int3" in capsys.readouterr().err
    assert main(["kv", "--layers", "1", "--kv-heads", "1", "--head-dim", "4", "--memory-gb", "0"]) == 2
    assert "memory-gb" in capsys.readouterr().err


def test_kv_per_tensor_parallel_rank(capsys):
    # 8 KV heads over 4 ranks: 2 per rank, a quarter of the block.
    assert main(["kv", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tensor-parallel-size", "4",
                 "--memory-gb", "1", "--request-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "8 kv_heads over 4 ranks (split): 2 per rank" in out
    assert f"= {2 * 32 * 2 * 128 * 16 * 2} bytes" in out
    assert "per rank" in out and "4 ranks hold 4 GiB" in out
    # Fewer KV heads than ranks: replicated, one per rank (the block does not shrink below one head).
    assert main(["kv", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tensor-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "replicated: each KV head on 2 ranks" in out and f"= {2 * 2 * 1 * 16 * 16 * 2} bytes" in out
    # The bundled model (9 query / 3 KV heads) splits over 3 ranks, not 2.
    assert main(["kv", "--tensor-parallel-size", "2"]) == 2
    assert "9 attention heads" in capsys.readouterr().err
