"""The gateway's configuration: defaults, overridden by a TOML file, overridden by command-line flags.

ServeConfig and Limits below are the one list of keys; each key's default, choices and bounds are its knob's
(contracts/options.py, which the children's configs read too). The pydantic models that check a file and the flags
are derived from these dataclasses and their knobs."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, PlainValidator, create_model

from contracts.control_tls import is_loopback
from contracts.options import conflicts, field_knob, knob
from edge.models.spec import DEFAULT_KEEP_ALIVE, FOREVER, PER_MODEL_KEYS, ModelSpec, keep_alive_seconds
from policies.validation import FileError, Invalid, Issue, Strict, parse_toml, read_text, validate

MODEL_KV_TOKENS = 8192  # a [[models]] model's decode KV pool unless it (or the server) sets kv_cache_tokens


class ConfigError(FileError):
    """A config file (or flag) that cannot be used; the message names the file, line and key."""


def planned(default):
    """A ServeConfig field the memory plan sets at start: no key of the file, no flag."""
    return field(default=default, metadata={"planned": True})


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = knob("max_body_bytes")
    default_max_tokens: int = knob("default_max_tokens")
    prefill_queue_size: int = knob("prefill_queue_size")
    header_timeout_s: float = knob("header_timeout_s")
    body_timeout_s: float = knob("body_timeout_s")
    request_timeout_s: float = knob("request_timeout_s")
    shutdown_grace_s: float = knob("shutdown_grace_s")


@dataclass(frozen=True)
class ServeConfig:
    """Every key of the file; what each means, its default and what it allows: contracts/options.py."""
    model: str | None = knob("model")  # None: the embedded SmolLM2-135M
    model_name: str = knob("model_name")
    host: str = knob("host")
    port: int = knob("port")
    ssl_certfile: str = knob("ssl_certfile")
    ssl_keyfile: str = knob("ssl_keyfile")
    ssl_ca_certs: str = knob("ssl_ca_certs")
    allow_unauthenticated: bool = knob("allow_unauthenticated")
    audit_log: str = knob("audit_log")
    audit_log_max_bytes: int = knob("audit_log_max_bytes")
    audit_log_backups: int = knob("audit_log_backups")
    audit_log_keep_days: float = knob("audit_log_keep_days")
    otlp_traces_endpoint: str = knob("otlp_traces_endpoint")
    prefill_workers: int = knob("prefill_workers")
    threads_per_worker: int = knob("threads_per_worker")
    device: str = knob("device")
    dtype: str = knob("dtype")
    weight_dtype: str = knob("weight_dtype")
    kv_type: str = knob("kv_type")
    prefill_weights: str = knob("prefill_weights")
    n_ctx: int = knob("n_ctx")
    n_batch: int = knob("n_batch")
    prefix_cache_tokens: int = knob("prefix_cache_tokens")
    kv_disk_bytes: int = knob("kv_disk_bytes")
    kv_return_bytes: int = knob("kv_return_bytes")
    kv_disk_dir: str = knob("kv_disk_dir")
    kv_storage: str = knob("kv_storage")
    kv_cache_tokens: int | None = knob("kv_cache_tokens")
    memory_budget: int = knob("memory_budget")
    gpu_memory_utilization: float = knob("gpu_memory_utilization")
    enforce_eager: bool = knob("enforce_eager")
    decode_forward: str = knob("decode_forward")
    deterministic: bool = knob("deterministic")
    max_num_seqs: int = knob("max_num_seqs")
    max_model_len: int = knob("max_model_len")
    swap_space_gib: float = knob("swap_space_gib")
    prefix_caching: bool = knob("prefix_caching")
    preemption_mode: str = knob("preemption_mode")
    speculative: str = knob("speculative")
    num_speculative_tokens: int = knob("num_speculative_tokens")
    max_backlog_bytes: int = knob("max_backlog_bytes")
    decode_yields_to_prefill: str = knob("decode_yields_to_prefill")
    cpu_decode_pace_ms: float = knob("cpu_decode_pace_ms")
    grammar_compile_timeout_s: float = knob("grammar_compile_timeout_s")
    grammar_compile_queue_per_key: int = knob("grammar_compile_queue_per_key")
    tool_call_parser: str = knob("tool_call_parser")
    reasoning_parser: str = knob("reasoning_parser")
    launch: bool = knob("launch")
    run_dir: str = knob("run_dir")
    engine_address: str = knob("engine_address")
    worker_addresses: tuple[str, ...] = knob("worker_addresses")
    control_secret_file: str = knob("control_secret_file")
    control_tls_certfile: str = knob("control_tls_certfile")
    control_tls_keyfile: str = knob("control_tls_keyfile")
    control_tls_ca: str = knob("control_tls_ca")
    allow_plaintext_control: bool = knob("allow_plaintext_control")
    control_handshake_timeout_s: float = knob("control_handshake_timeout_s")
    worker_heartbeat_timeout_s: float = knob("worker_heartbeat_timeout_s")
    engine_heartbeat_timeout_s: float = knob("engine_heartbeat_timeout_s")
    ray: str = knob("ray")  # "": everything on this box; else the prefill workers and engines are Ray actors
    decode_engines: int = knob("decode_engines")
    ray_decode_resource: str = knob("ray_decode_resource")
    ray_prefill_cpus: float = knob("ray_prefill_cpus")
    policy: str = knob("policy")
    limits: Limits = field(default_factory=Limits)
    log_level: str = knob("log_level")
    # several models (issue 45; edge.models): the [[models]] tables; empty: the one model of `model`
    models: tuple[ModelSpec, ...] = ()
    keep_alive: str = knob("keep_alive")  # a [[models]] table's default (Ollama's meaning)
    model_load_timeout_s: float = knob("model_load_timeout_s")  # a request's wait for its model's load, at most
    # set by the memory plan at start (edge/check_model/memory.py), not by the file or a flag; the launcher copies them
    # by name into the process configs
    weight_second_set: bool = planned(True)  # the engine may hold the float set beside the quantized one
    weight_float_set: bool = planned(True)  # the engine may hold float weights at all
    weight_repack: bool = planned(False)  # the engine repacks the mapped GGUF's matrices (room for the copy)
    prefill_copy_kinds: tuple[str, ...] | None = planned(None)  # the copies prefill_weights auto may measure


PATH_KEYS = ("model", "policy", "audit_log", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "control_secret_file",
             "control_tls_certfile", "control_tls_keyfile", "control_tls_ca")


def _file_model(cls, **extra):
    """A pydantic model with the dataclass's keys and defaults, and its knobs' choices and bounds."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: _file_field(f, hints[f.name]) for f in dataclasses.fields(cls)
              if f.name not in extra and not f.metadata.get("planned")}
    return create_model(f"{cls.__name__}File", __base__=Strict, **fields, **extra)


def _file_field(f: dataclasses.Field, hint) -> tuple:
    hint, bounds = _checked_hint(f, hint)
    default = list(f.default) if isinstance(f.default, tuple) else f.default
    return hint, Field(default, **bounds)


def _checked_hint(f: dataclasses.Field, hint) -> tuple:
    """The type a file's value must have (its knob's choices as a Literal) and its knob's bounds."""
    entry, exclude = field_knob(f)
    if entry is not None and entry.allowed(exclude):
        hint = Literal[entry.allowed(exclude)]
    elif typing.get_origin(hint) is tuple:  # TOML arrays are lists; the dataclass keeps a tuple
        hint = list[typing.get_args(hint)[0]]
    return hint, (entry.bounds if entry else {})


def _keep_alive(value):
    keep_alive_seconds(value)  # ValueError: the message names what is accepted
    return value


KeepAlive = typing.Annotated[str | int | float, PlainValidator(_keep_alive)]  # one message, not one a type
_SERVE_HINTS = typing.get_type_hints(ServeConfig)
# a [[models]] table: its name and GGUF, keep_alive and pinned, and the per-model settings (unset: the server's)
ModelFile = create_model(
    "ModelFile", __base__=Strict, name=(str, Field(min_length=1, max_length=256)), model=(str, Field(min_length=1)),
    keep_alive=(KeepAlive | None, None), pinned=(bool, False),
    **{f.name: (hint | None, Field(None, **bounds)) for f in dataclasses.fields(ServeConfig)
       if f.name in PER_MODEL_KEYS for hint, bounds in [_checked_hint(f, _SERVE_HINTS[f.name])]})
LimitsFile = _file_model(Limits)
ServeFile = _file_model(ServeConfig, limits=(LimitsFile, LimitsFile()), models=(list[ModelFile], []),
                        keep_alive=(KeepAlive, DEFAULT_KEEP_ALIVE))


def load_config(path: str | None, overrides: dict) -> ServeConfig:
    values = _file_values(path) if path else {}
    flags = {key: value for key, value in overrides.items() if value is not None}
    try:  # the file's values were checked already: what fails now came from a flag
        checked = validate(ServeFile, {**values, **flags}, {})
    except Invalid as err:
        issues = [dataclasses.replace(i, key="--" + i.key.replace("_", "-")) for i in err.issues]
        raise ConfigError("command line", issues) from None
    values = checked.model_dump()
    if clashes := conflicts(values):
        raise ConfigError(path or "command line", [Issue(name, message) for name, message in clashes])
    if values["decode_engines"] > 1 and not values["ray"]:
        raise ConfigError(path or "command line", [Issue("decode_engines", "several decode engines need ray (one "
                                                   "engine per GPU across the cluster's nodes, docs/cluster.md)")])
    limits = Limits(**values.pop("limits"))
    values["keep_alive"] = str(values["keep_alive"])  # a number in the file: seconds, as Ollama reads it
    models = _model_specs(values.pop("models"), values, path or "command line")
    return ServeConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}, limits=limits,
                       models=models)


# keys that name one model's processes: with [[models]] each model's are made and named by the server
_ONE_MODEL_KEYS = {"model": "give each model's GGUF in its [[models]] table",
                   "model_name": "give each model's name in its [[models]] table",
                   "engine_address": "each model's engine is launched by the server", "ray": "not with ray yet",
                   "worker_addresses": "each model's workers are launched by the server"}


def _model_specs(tables: list[dict], values: dict, where: str) -> tuple[ModelSpec, ...]:
    """The [[models]] tables as ModelSpecs, each name once, none beside the keys of a single model's processes."""
    if not tables:
        return ()
    issues = [Issue(key, f"not with [[models]]: {why}") for key, why in _ONE_MODEL_KEYS.items() if values.get(key)]
    if not values["launch"]:
        issues.append(Issue("launch", "not with [[models]]: the server starts and stops each model's processes"))
    seen: set[str] = set()
    for i, table in enumerate(tables):
        if table["name"] in seen:
            issues.append(Issue(f"models[{i}].name", f"the name {table['name']!r} is given to two models"))
        seen.add(table["name"])
    if issues:
        raise ConfigError(where, issues)
    default_s = keep_alive_seconds(values["keep_alive"])
    return tuple(ModelSpec(t["name"], t["model"], tuple((k, t[k]) for k in PER_MODEL_KEYS if t.get(k) is not None),
                           default_s if t.get("keep_alive") is None else keep_alive_seconds(t["keep_alive"]),
                           t["pinned"], str(values["keep_alive"] if t.get("keep_alive") is None else t["keep_alive"]))
                 for t in tables)


def _file_values(path: str) -> dict:
    """The keys the file sets, checked; a relative policy path is made relative to the file."""
    try:
        data, lines = parse_toml(read_text(path))
        values = validate(ServeFile, data, lines).model_dump(exclude_unset=True)
    except Invalid as err:
        raise ConfigError(path, err.issues) from None
    here = os.path.dirname(os.path.abspath(path))
    for key in PATH_KEYS:  # a relative path in the file is relative to the file, not to where edge serve starts
        if values.get(key) and not os.path.isabs(values[key]):
            values[key] = os.path.join(here, values[key])
    for table in values.get("models", ()):
        table["model"] = os.path.join(here, table["model"])  # an absolute one stays as it is
    return values


def configured_models(config: ServeConfig, default_path: str) -> tuple[ModelSpec, ...]:
    """The models this server serves: the [[models]] tables, or the single model as a one-entry table (loaded at
    start, never unloaded). default_path: the embedded GGUF, for a config without `model`."""
    if config.models:
        return config.models
    path = config.model or default_path
    return (ModelSpec(config.model_name or Path(path).name.removesuffix(".gguf"), path, (), FOREVER, True,
                      "-1"),)


def model_config(config: ServeConfig, spec: ModelSpec) -> ServeConfig:
    """The single-model config of one configured model: the server's settings, the model's own over them; its
    run dir, audit log and quota state apart from the other models' (each model's stack has its own)."""
    own = dict(spec.settings)
    if config.models and "kv_cache_tokens" not in own and not config.kv_cache_tokens:
        own["kv_cache_tokens"] = MODEL_KV_TOKENS  # else the plan would give each model all the budget left
    apart = {key: f"{value}.{spec.name}" if key == "audit_log" else os.path.join(value, spec.name)
             for key in ("audit_log", "run_dir") if (value := getattr(config, key))}
    return dataclasses.replace(config, model=spec.model, model_name=spec.name, models=(), **own, **apart)


def policy_path(config: ServeConfig) -> str:
    return config.policy or str(Path(__file__).resolve().parent.parent / "policies" / "default.toml")


def default_threads(config: ServeConfig) -> int:
    return config.threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, config.prefill_workers))


LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


def worker_kv_type(config: ServeConfig, engine_address: str) -> str:
    """The KV type a launched prefill worker runs with. auto: f16 when the worker's handoff to the engine stays
    on this host (a Unix socket, or TCP to a loopback address): there q8_0's half-size message saves nothing
    and its prefill costs TTFT (+31 % at 512 prompt tokens, +50 % at 1024, docs/handoff.md); q8_0 when the
    handoff crosses the network, where the wire is the cost. The pool still quantizes to int8 on the device
    if kv_storage says so."""
    if config.kv_type != "auto":
        return config.kv_type
    return "f16" if is_local_address(engine_address) else "q8_0"


def is_local_address(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.removeprefix("tcp://").rpartition(":")[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def open_without_authentication(config: ServeConfig, policy) -> str:
    """Where the gateway would listen beyond this host with nothing that authenticates a client: no API key in
    `policy` and no client certificates (ssl_ca_certs); "" when it listens on loopback only or clients must prove
    who they are. `edge serve` refuses such a start unless the operator says it is meant (docs/security.md)."""
    if is_loopback(config.host) or policy.keys or config.ssl_ca_certs:
        return ""
    if not config.host:  # aiohttp then listens on every interface
        return f"every interface, port {config.port}"
    return f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
