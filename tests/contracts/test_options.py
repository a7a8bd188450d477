"""Each knob's allowed values are defined once (contracts.options) and every side reads them: the `edge serve`
flags, the config file's checks, `edge check-model`, the launcher, and each child's config, whether it comes from
the launcher or from flags typed by hand. Each test derives what it expects from the knobs, so a new knob or choice
is checked without a line here."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from contracts.options import AUTO, FLOAT_WEIGHT_DTYPES, KNOBS, OptionError, check
from contracts.process_config import (
    EngineProcessConfig,
    WorkerProcessConfig,
    decode_config,
    encode_config,
    hand_parser,
    parse_config,
)
from edge.cli import add_serve_flags
from edge.config import ConfigError, Limits, ServeConfig, load_config
from edge.launch.launcher import engine_config, worker_config

CHILDREN = (EngineProcessConfig, WorkerProcessConfig)
WIRING = {"model": "m.gguf", "listen": "unix:/tmp/x.sock"}  # the fields every child needs that are no setting
OUTSIDE = "not-a-choice"


def knob_fields(cls) -> list[tuple[str, tuple[str, ...]]]:
    """(knob name, the choices this class allows) for every field of `cls` that reads a knob."""
    return [(f.name, KNOBS[f.name].allowed(f.metadata.get("exclude", ()))) for f in dataclasses.fields(cls)
            if f.metadata.get("knob")]


def outside_bounds(name: str) -> list:
    """A value just past each bound of the knob, of its own type."""
    entry, values = KNOBS[name], []
    for key, limit in entry.bounds.items():
        step = (1 if entry.type is int else 0.01) * (-1 if key != "le" else 1)
        values.append(entry.type(limit + step) if key != "gt" else entry.type(limit))
    return values


def test_every_serve_key_is_a_knob_with_its_default():
    for cls in (ServeConfig, Limits):
        for f in dataclasses.fields(cls):
            # the [limits] table is itself a dataclass of knobs; the memory plan's fields are set at start, no keys
            if f.name not in ("limits", "models") and not f.metadata.get("planned"):  # tables of their own
                assert f.metadata.get("knob") == f.name, f"{cls.__name__}.{f.name} reads no knob"
                assert f.default == KNOBS[f.name].default


def test_the_serve_flags_offer_exactly_the_knobs_choices():
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    flags = {action.dest: action for action in parser._actions if action.option_strings}
    assert set(flags) - {"help"} == {name for name, entry in KNOBS.items() if entry.flag}
    for name, action in flags.items():
        if name != "help":
            assert tuple(action.choices or ()) == KNOBS[name].choices, name
            assert action.help == KNOBS[name].help and action.default is None  # unset: the file's value stands


@pytest.mark.parametrize("name", [n for n, e in KNOBS.items() if e.choices and e.type is str
                                  and n in {f.name for f in dataclasses.fields(ServeConfig)}])
def test_the_config_refuses_a_value_outside_the_choices_and_says_which(name, tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(f'{name} = "{OUTSIDE}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(path), {})
    assert str(info.value) == f"{path}:1: {name}: expected one of {list(KNOBS[name].choices)}, got '{OUTSIDE}'"
    for choice in KNOBS[name].choices:  # and takes each one (dtype alone: no weight_dtype to contradict)
        assert getattr(load_config(None, {name: choice}), name) == choice


@pytest.mark.parametrize("name", [n for n, e in KNOBS.items() if e.bounds])
def test_the_config_and_the_children_refuse_a_value_past_a_bound(name):
    in_limits = name in {f.name for f in dataclasses.fields(Limits)}
    for value in outside_bounds(name):
        flags = {"limits": {name: value}} if in_limits else {name: value}
        if name in {f.name for f in dataclasses.fields(ServeConfig)} or in_limits:
            with pytest.raises(ConfigError, match=f"{name.replace('_', '-')}: expected a value"):
                load_config(None, flags)
        for cls in CHILDREN:
            if name in {f.name for f in dataclasses.fields(cls)}:
                with pytest.raises(OptionError, match=f"^{name}: expected a value"):
                    check(cls(**WIRING, **{name: value}))


@pytest.mark.parametrize("cls", CHILDREN, ids=lambda cls: cls.__name__)
def test_a_child_takes_exactly_the_knobs_choices_by_hand_and_from_the_launcher(cls):
    flags = {action.dest: action for action in hand_parser(cls, "")._actions}
    for name, allowed in knob_fields(cls):
        if allowed:
            assert tuple(flags[name].choices) == allowed, name
            for choice in allowed:
                assert getattr(decode_config(cls, encode_config(cls(**WIRING, **{name: _typed(name, choice)}))),
                               name) == _typed(name, choice)
            outside = cls(**WIRING, **{name: _typed(name, OUTSIDE)})
            with pytest.raises(OptionError, match=f"^{name}: expected one of {list(allowed)}".replace("[", r"\[")):
                decode_config(cls, encode_config(outside))
            with pytest.raises(SystemExit, match=name):  # the process stops with the knob named
                parse_config(cls, ["--config-json", encode_config(outside)], "")


def _typed(name: str, choice: str):
    return (choice,) if KNOBS[name].type is tuple else choice


def test_a_worker_resolves_no_kv_type_itself():
    """kv_type auto is the launcher's to resolve (by where the engine is): a worker refuses it."""
    with pytest.raises(OptionError, match=r"kv_type: expected one of \['f16', 'q8_0', 'q4_0'\], got 'auto'"):
        check(WorkerProcessConfig(**WIRING, kv_type=AUTO))


def test_the_launcher_hands_each_child_every_setting_it_shares_with_the_serve_config():
    """Every knob a child reads comes from the serve config by name, none is dropped or renamed on the way."""
    changed = {}
    for name, entry in KNOBS.items():
        if name in {f.name for f in dataclasses.fields(ServeConfig)} and entry.type in (int, float, bool, str):
            changed[name] = _another_value(entry)
    config = dataclasses.replace(ServeConfig(), **changed)
    engine = engine_config(config, "m.gguf", "unix:/e")
    worker = worker_config(config, "m.gguf", "prefill-0", "unix:/w", "unix:/e", "q4_0", 3)
    for child in (engine, worker):
        for name, _ in knob_fields(type(child)):
            if name in changed and name not in ("kv_type", "threads_per_worker"):  # resolved by the launcher
                assert getattr(child, name) == changed[name], name
    assert (worker.kv_type, worker.threads_per_worker) == ("q4_0", 3)


def _another_value(entry):
    """An allowed value other than the default; the float-weights pair is left alone (they must agree)."""
    if entry.name in ("dtype", "weight_dtype"):
        return FLOAT_WEIGHT_DTYPES[0]
    if entry.type is bool:
        return not entry.default
    if entry.choices:
        return next(c for c in entry.choices if c != entry.default)
    if entry.type is str:
        return "x"
    low = entry.bounds.get("ge", entry.bounds.get("gt", 0))
    value = entry.type(low + 1 if entry.type is int else min(low + 0.5, entry.bounds.get("le", low + 1)))
    return value if value != entry.default else value + (1 if entry.type is int else 0.25)


def test_float_weights_may_not_contradict_the_dtype_anywhere():
    """The one rule between two knobs, read by the config and the engine alike."""
    with pytest.raises(ConfigError, match="weight_dtype: float16 weights with dtype bfloat16"):
        load_config(None, {"weight_dtype": "float16", "dtype": "bfloat16"})
    with pytest.raises(OptionError, match="weight_dtype: float16 weights with dtype bfloat16"):
        check(EngineProcessConfig(**WIRING, weight_dtype="float16", dtype="bfloat16"))
    check(EngineProcessConfig(**WIRING, weight_dtype="float16", dtype="float16"))


def test_check_model_sizes_and_checks_every_choice():
    from edge.check_model.command import add_arguments
    from edge.check_model.sizes import WEIGHT_DTYPES
    # gguf holds no weights of its own (the engine multiplies the file's mapped blocks): nothing to size
    assert WEIGHT_DTYPES == KNOBS["weight_dtype"].allowed(exclude=(AUTO, "gguf"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    kv_type = next(a for a in parser._actions if a.dest == "kv_type")
    assert tuple(kv_type.choices) == KNOBS["kv_type"].allowed(exclude=(AUTO,))
    with pytest.raises(SystemExit):
        parser.parse_args(["m.gguf", "--gpu-memory-utilization", "1.5"])


def test_the_engines_own_lists_agree_with_the_knobs():
    """The implementations keep their own maps (a name to a torch dtype, a llama.cpp file type): each knob offers
    exactly what its implementation takes, auto being the process's to resolve."""
    from contracts.kv_dtypes import KV_DTYPES
    from decode_gpu.core.scheduler import PREEMPTION_MODES
    from decode_gpu.core.speculative import METHODS
    from decode_gpu.kv.pool import STORAGE_DTYPES
    from decode_gpu.model.weight_quant import WEIGHT_DTYPES
    from prefill_cpu.prefill_weights import CHOICES
    assert set(KNOBS["weight_dtype"].choices) == set(WEIGHT_DTYPES)
    assert set(KNOBS["kv_storage"].choices) == {AUTO, *STORAGE_DTYPES}
    assert set(KNOBS["kv_type"].choices) == {AUTO, *KV_DTYPES}
    assert KNOBS["speculative"].choices == METHODS and KNOBS["preemption_mode"].choices == PREEMPTION_MODES
    assert set(KNOBS["prefill_weights"].choices) == set(CHOICES)


def test_the_grammar_compile_time_limit_is_a_serve_setting(tmp_path):
    assert ServeConfig().grammar_compile_timeout_s == KNOBS["grammar_compile_timeout_s"].default == 5.0
    path = tmp_path / "serve.toml"
    path.write_text("grammar_compile_timeout_s = 0.5\n")
    assert load_config(str(path), {}).grammar_compile_timeout_s == 0.5
    path.write_text("grammar_compile_timeout_s = 0\n")
    with pytest.raises(ConfigError, match=r"grammar_compile_timeout_s: expected a value >= 0.1, got 0"):
        load_config(str(path), {})
