"""The engine flags of every command come from EngineConfig's fields: same names, choices and defaults."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pagedserve.config import MODEL_DTYPES, EngineConfig
from pagedserve.entrypoints.cli.args import engine_config_from_args
from pagedserve.entrypoints.cli.main import build_parser


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["chat"], ["bench", "throughput"],
                                     ["bench", "latency"], ["trace"]])
def test_every_cli_field_is_a_flag_and_defaults_stay_the_configs(command, capsys):
    args = parse(*command)
    assert engine_config_from_args(args) == EngineConfig()
    with pytest.raises(SystemExit):
        parse(*command, "--help")
    text = capsys.readouterr().out
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.metadata["cli"] and f.name != "model":
            assert flag in text, (command, flag)
        elif not f.metadata["cli"]:
            assert flag not in text or f.name == "served_model_name", (command, flag)


def test_flags_reach_the_config():
    args = parse("generate", "hi", "--dtype", "float32", "--max-num-seqs", "7", "--no-decode-stack",
                 "--no-enable-prefix-caching", "--cpu-arch", "x86-64-v3", "--kv-cache-memory-gb", "0.5")
    cfg = engine_config_from_args(args)
    assert (cfg.dtype, cfg.max_num_seqs, cfg.decode_stack, cfg.enable_prefix_caching) == ("float32", 7, False, False)
    assert cfg.cpu_arch == "x86-64-v3" and cfg.kv_cache_memory_gb == 0.5
    assert cfg.block_size == EngineConfig().block_size  # not given: the config's default


def test_dtype_choices_are_the_configs(capsys):
    with pytest.raises(SystemExit):
        parse("generate", "hi", "--dtype", "float16")
    err = capsys.readouterr().err
    assert all(d in err for d in MODEL_DTYPES)


def test_config_validates_switches():
    with pytest.raises(ValueError, match="decode_stack"):
        EngineConfig(decode_stack="yes")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float16")
    assert EngineConfig(dtype="bf16").dtype == "bf16"
