"""The gateway's configuration: defaults, overridden by a TOML file, overridden by command-line flags.

ServeConfig and Limits below are the one list of keys and defaults; the pydantic models that check a file
and the flags against them are derived from these dataclasses, with the bounds and choices added here."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, create_model

from policies.validation import FileError, Invalid, Issue, Strict, parse_toml, read_text, validate


class ConfigError(FileError):
    """A config file (or flag) that cannot be used; the message names the file, line and key."""


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256  # when a request gives none (the policy caps what it may ask for)
    prefill_queue_size: int = 64  # waiting prompts beyond this get 429
    header_timeout_s: float = 10.0  # a client must send its headers within this
    body_timeout_s: float = 30.0  # ... and its body within this
    request_timeout_s: float = 300.0  # overall deadline of one request
    shutdown_grace_s: float = 5.0  # on SIGTERM, in-flight requests may finish for this long, then are aborted


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None  # GGUF path; None: the embedded SmolLM2-135M
    model_name: str = ""  # the id clients use; "" -> the GGUF file name without .gguf
    host: str = "127.0.0.1"
    port: int = 8000
    ssl_certfile: str = ""  # PEM certificate (chain): serve HTTPS; "" serves plain HTTP
    ssl_keyfile: str = ""  # its private key (PEM)
    ssl_ca_certs: str = ""  # CA bundle: clients must present a certificate it signed (mutual TLS)
    audit_log: str = ""  # file for one JSON line per request (docs/audit.md); "" writes none
    audit_log_max_bytes: int = 100 << 20  # the audit log rotates past this size
    audit_log_backups: int = 5  # rotated audit files kept
    otlp_traces_endpoint: str = ""  # OTLP endpoint for OpenTelemetry request traces; "" traces nothing
    prefill_workers: int = 1
    threads_per_worker: int = 0  # 0: cores / workers
    device: str = "auto"
    dtype: str = "auto"  # decode weights and activations: auto (bfloat16 on CUDA and bf16-capable CPUs), float32, ...
    weight_dtype: str = "auto"  # decode linear weights: auto | bfloat16 | float16 | float32 (= dtype) | int8 | int4
    kv_type: str = "auto"  # llama.cpp KV cache and wire format; auto: f16 next to the engine, q8_0 across hosts
    prefill_weights: str = "auto"  # what llama.cpp prefills with: auto | given | f16 | bf16 | q8_0 (docs/config.md)
    n_ctx: int = 4096
    n_batch: int = 256  # prompt tokens per llama.cpp call (docs/config.md)
    prefix_cache_tokens: int = 2048  # per worker: KV of recent prompts kept for reuse (shared prefixes); 0: off
    kv_storage: str = "auto"
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9  # on CUDA without kv_cache_tokens: the engine's share of total GPU memory
    enforce_eager: bool = False  # no CUDA graphs in the decode step
    max_num_seqs: int = 32
    max_model_len: int = 4096
    swap_space_gib: float = 4.0  # host memory for preempted decode sequences; 0: no preemption by swap
    prefix_caching: bool = True  # decode requests whose prompts start alike share the prefix's KV blocks
    preemption_mode: str = "swap"  # swap | recompute: a preempted decode sequence's KV goes to host memory, or is
    # freed and prefilled again by a worker at its priority (docs/decode.md)
    speculative: str = "off"  # off | ngram: prompt-lookup drafts verified in one forward (docs/decode.md)
    num_speculative_tokens: int = 4  # draft tokens per sequence and step at most
    max_backlog_bytes: int = 512 << 20  # KV handoff bytes waiting for decode admission; beyond: 503 engine_busy
    decode_yields_to_prefill: str = "auto"  # auto | on | off; auto: on when the engine decodes on the CPU
    cpu_decode_pace_ms: float = 0  # CPU decode beside local workers: one step at most every N ms while prompts wait
    launch: bool = True  # start the engine and workers here; False: connect to the addresses below
    run_dir: str = ""  # where local sockets live; "" -> a fresh temporary directory
    engine_address: str = ""  # "" -> unix socket in run_dir
    worker_addresses: tuple[str, ...] = ()  # "" -> unix sockets in run_dir
    control_secret_file: str = ""  # shared secret of the control sockets; required for TCP addresses
    worker_heartbeat_timeout_s: float = 5.0  # a prefill worker silent this long is declared stuck and restarted
    # Ray (docs/cluster.md): "" runs everything on this box; "auto" or a cluster address runs the prefill workers and
    # decode engines as Ray actors placed across the cluster's nodes
    ray: str = ""
    decode_engines: int = 1  # with ray: engines, each needing one unit of ray_decode_resource
    ray_decode_resource: str = "GPU"  # with ray: what each engine asks for (a custom resource on CPU-only clusters)
    ray_prefill_cpus: float = 0  # with ray: CPUs each prefill worker asks for; 0: threads_per_worker, or 1
    policy: str = ""  # policy file: filters, API keys, classes, degradation tiers; "" -> policies/default.toml
    limits: Limits = field(default_factory=Limits)
    log_level: str = "INFO"


CHOICES = {"kv_type": ("auto", "f16", "q8_0", "q4_0"), "device": ("auto", "cpu", "cuda"),
           # prefill_cpu.prefill_weights.CHOICES (not imported: the gateway does not load llama.cpp)
           "prefill_weights": ("auto", "given", "f16", "bf16", "q8_0"),
           "dtype": ("auto", "float32", "bfloat16", "float16"),
           "weight_dtype": ("auto", "bfloat16", "float16", "float32", "int8", "int4", "q8_0"),
           "decode_yields_to_prefill": ("auto", "on", "off"),
           "kv_storage": ("auto", "float32", "float16", "bfloat16", "int8", "int4"),
           "speculative": ("off", "ngram"), "preemption_mode": ("swap", "recompute"),
           "log_level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")}
# the smallest (and largest) sensible values; a 0 where one is allowed means "off" or "pick for me"
BOUNDS = {"port": {"ge": 0, "le": 65535}, "prefill_workers": {"ge": 1}, "decode_engines": {"ge": 1},
          "ray_prefill_cpus": {"ge": 0}, "cpu_decode_pace_ms": {"ge": 0}, "threads_per_worker": {"ge": 0},
          "n_ctx": {"ge": 1}, "n_batch": {"ge": 1}, "prefix_cache_tokens": {"ge": 0}, "kv_cache_tokens": {"ge": 0},
          "max_num_seqs": {"ge": 1}, "num_speculative_tokens": {"ge": 1, "le": 16}, "audit_log_max_bytes": {"ge": 4096}, "audit_log_backups": {"ge": 0}, "swap_space_gib": {"ge": 0}, "max_backlog_bytes": {"ge": 1}, "worker_heartbeat_timeout_s": {"gt": 1}, "max_model_len": {"ge": 1}, "gpu_memory_utilization": {"gt": 0, "le": 1}, "max_body_bytes": {"ge": 1},
          "default_max_tokens": {"ge": 1}, "prefill_queue_size": {"ge": 1}, "header_timeout_s": {"gt": 0},
          "body_timeout_s": {"gt": 0}, "request_timeout_s": {"gt": 0}, "shutdown_grace_s": {"ge": 0}}


PATH_KEYS = ("model", "policy", "audit_log", "ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "control_secret_file")


def _file_model(cls, **extra):
    """A pydantic model with the dataclass's keys and defaults, plus the choices and bounds above."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: (_file_type(f.name, hints[f.name]), Field(_file_default(f.default), **BOUNDS.get(f.name, {})))
              for f in dataclasses.fields(cls) if f.name not in extra}
    return create_model(f"{cls.__name__}File", __base__=Strict, **fields, **extra)


def _file_default(default):
    return list(default) if isinstance(default, tuple) else default


def _file_type(name: str, hint):
    if name in CHOICES:
        return Literal[CHOICES[name]]
    if typing.get_origin(hint) is tuple:  # TOML arrays are lists; the dataclass keeps a tuple
        return list[typing.get_args(hint)[0]]
    return hint


LimitsFile = _file_model(Limits)
ServeFile = _file_model(ServeConfig, limits=(LimitsFile, LimitsFile()))


def load_config(path: str | None, overrides: dict) -> ServeConfig:
    values = _file_values(path) if path else {}
    flags = {key: value for key, value in overrides.items() if value is not None}
    try:  # the file's values were checked already: what fails now came from a flag
        checked = validate(ServeFile, {**values, **flags}, {})
    except Invalid as err:
        issues = [dataclasses.replace(i, key="--" + i.key.replace("_", "-")) for i in err.issues]
        raise ConfigError("command line", issues) from None
    values = checked.model_dump()
    weights, dtype = values["weight_dtype"], values["dtype"]
    if weights in ("bfloat16", "float16", "float32") and dtype not in ("auto", weights):
        raise ConfigError(path or "command line", [Issue("weight_dtype", f"{weights} weights with dtype {dtype}: "
                                                   f"float weights are in the model's dtype; set one of the two")])
    if values["decode_engines"] > 1 and not values["ray"]:
        raise ConfigError(path or "command line", [Issue("decode_engines", "several decode engines need ray (one "
                                                   "engine per GPU across the cluster's nodes, docs/cluster.md)")])
    limits = Limits(**values.pop("limits"))
    return ServeConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}, limits=limits)


def _file_values(path: str) -> dict:
    """The keys the file sets, checked; a relative policy path is made relative to the file."""
    try:
        data, lines = parse_toml(read_text(path))
        values = validate(ServeFile, data, lines).model_dump(exclude_unset=True)
    except Invalid as err:
        raise ConfigError(path, err.issues) from None
    for key in PATH_KEYS:  # a relative path in the file is relative to the file, not to where edge serve starts
        if values.get(key) and not os.path.isabs(values[key]):
            values[key] = os.path.join(os.path.dirname(os.path.abspath(path)), values[key])
    return values


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
