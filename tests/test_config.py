"""The config's modes are Literal types: checked when a config is made, offered as a flag's choices; every
flag's help carries the field's comment, its default and its environment variable."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.common.config import (
    SchedulerConfig,
    WorkerConfig,
    add_config_args,
    choices_of,
    field_descriptions,
    parse_config,
)


def test_modes_are_checked_when_a_config_is_made():
    assert choices_of(SchedulerConfig)["preemption_mode"] == ("recompute", "swap", "auto")
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute, swap, auto"):
        SchedulerConfig(preemption_mode="sometimes")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        WorkerConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="attention_backend"):
        WorkerConfig(attention_backend="cuda")


def test_a_mode_flag_offers_its_choices_and_refuses_others(capsys):
    assert parse_config(SchedulerConfig, ["--kv-policy", "reserved-max"]).kv_policy == "reserved-max"
    with pytest.raises(SystemExit):
        parse_config(SchedulerConfig, ["--scheduling-policy", "lifo"])
    assert "invalid choice: 'lifo'" in capsys.readouterr().err


def test_a_bad_mode_from_the_environment_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_PREEMPTION_MODE", "never")
    with pytest.raises(SystemExit) as done:
        parse_config(SchedulerConfig, [])
    assert done.value.code == 2  # a configuration error: the supervisor does not restart it
    assert capsys.readouterr().err.startswith("error: --preemption-mode: bad setting: preemption_mode must")


def test_every_flag_has_a_description_default_and_environment_variable():
    for config_cls in (SchedulerConfig, WorkerConfig):
        parser = argparse.ArgumentParser()
        add_config_args(parser, config_cls)
        for action in parser._actions[1:]:  # (after --help)
            assert action.help and "(default " in action.help and "env PAGEDSERVE_" in action.help
        descriptions = field_descriptions(config_cls)
        undescribed = [name for name, text in descriptions.items() if not text and name not in ("port",)]
        assert not undescribed, f"{config_cls.__name__} fields without a comment: {undescribed}"
    worker = field_descriptions(WorkerConfig)
    assert worker["block_size"] == "tokens per KV block"  # beside the field
    assert worker["kv_cache_dtype"].startswith("auto: the model's dtype. fp8 (or fp8_e4m3)")  # above it
    text = parser.format_help()
    assert "--attention-backend {auto,torch,triton}" in text and "default 'auto'" in text


def test_grammar_threads_has_a_finite_range(tiny_model_dir, capsys):
    model = ["--model", str(tiny_model_dir)]  # (the default model directory exists only once made)
    assert WorkerConfig(grammar_threads=4).grammar_threads == 4
    assert parse_config(WorkerConfig, [*model, "--grammar-threads", "2"]).grammar_threads == 2
    for bad in (-1, 65):
        with pytest.raises(ValueError, match=r"grammar_threads must be within \[0, 64\]"):
            WorkerConfig(grammar_threads=bad)
    with pytest.raises(SystemExit) as done:
        parse_config(WorkerConfig, [*model, "--grammar-threads", "1000"])
    assert done.value.code == 2
    assert "--grammar-threads: bad setting: grammar_threads" in capsys.readouterr().err
