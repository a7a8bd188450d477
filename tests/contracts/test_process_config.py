"""The typed config each child process gets: the launcher's one JSON argument, or flags typed by hand, both checked
against the knobs; a wrong type or a stray argument stops the child with the field named."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from contracts.options import OptionError
from contracts.process_config import (
    CONFIG_FLAG,
    EngineProcessConfig,
    WorkerProcessConfig,
    config_argv,
    decode_config,
    parse_config,
)

WIRING = {"model": "m.gguf", "listen": "unix:/tmp/x.sock"}


@pytest.mark.parametrize("cls", [EngineProcessConfig, WorkerProcessConfig], ids=lambda cls: cls.__name__)
def test_flags_by_hand_build_the_same_config_as_the_launchers_argument(cls):
    config = cls(**WIRING)
    assert parse_config(cls, config_argv(config), "") == config
    assert parse_config(cls, ["--model", "m.gguf", "--listen", "unix:/tmp/x.sock"], "") == config


def test_each_kind_of_flag_by_hand():
    config = parse_config(EngineProcessConfig, ["--model", "m.gguf", "--listen", "unix:/e", "--no-prefix-caching",
                                                "--enforce-eager", "--kv-cache-tokens", "512",
                                                "--gpu-memory-utilization", "0.5", "--speculative", "ngram"], "")
    assert config == EngineProcessConfig(model="m.gguf", listen="unix:/e", prefix_caching=False, enforce_eager=True,
                                         kv_cache_tokens=512, gpu_memory_utilization=0.5, speculative="ngram")
    worker = parse_config(WorkerProcessConfig, [*sum(([f"--{k}", v] for k, v in WIRING.items()), []),
                                                "--extra-kv-types", "q4_0", "f16"], "")
    assert worker.extra_kv_types == ("q4_0", "f16")  # a tuple, as from JSON: the config stays hashable
    assert parse_config(WorkerProcessConfig, ["--model", "m", "--listen", "l", "--extra-kv-types"], "") \
        .extra_kv_types == ()  # the flag alone: no extra contexts


def test_a_wrong_type_is_refused_with_the_field_named():
    text = '{"model": "m", "listen": "l", "max_num_seqs": "8"}'
    with pytest.raises(OptionError, match=r"Expected `int`, got `str` - at `\$.max_num_seqs`"):
        decode_config(EngineProcessConfig, text)
    with pytest.raises(OptionError, match="model"):  # a field without a default is required
        decode_config(WorkerProcessConfig, '{"listen": "l"}')


def test_the_launchers_argument_comes_alone():
    argv = [*config_argv(EngineProcessConfig(**WIRING)), "--max-num-seqs", "4"]
    with pytest.raises(SystemExit, match=f"{CONFIG_FLAG} takes the whole config"):
        parse_config(EngineProcessConfig, argv, "")


def test_a_setting_out_of_bounds_by_hand_stops_the_process_naming_the_knob():
    with pytest.raises(SystemExit, match="num_speculative_tokens: expected a value <= 16, got 17"):
        parse_config(EngineProcessConfig, ["--model", "m", "--listen", "l", "--num-speculative-tokens", "17"], "")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineProcessConfig(**WIRING).max_num_seqs = 1  # type: ignore[misc]


@pytest.mark.parametrize("module,flag", [("decode_gpu.service.server", "--max-num-seqs"),
                                         ("prefill_cpu.worker", "--prefix-cache-tokens")])
@pytest.mark.slow
def test_the_child_processes_list_their_flags(module, flag):
    """Started by hand for debugging: `python -m <child> --help` names every setting and the launcher's form."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and flag in done.stdout and CONFIG_FLAG in done.stdout
