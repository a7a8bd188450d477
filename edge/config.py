"""The gateway's configuration: defaults, overridden by a TOML file, overridden by command-line flags."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and key."""


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
    prefill_workers: int = 1
    threads_per_worker: int = 0  # 0: cores / workers
    device: str = "auto"
    kv_type: str = "q8_0"  # llama.cpp KV cache and wire format
    n_ctx: int = 4096
    n_batch: int = 128  # prompt tokens per llama.cpp call
    prefix_cache_tokens: int = 2048  # per worker: KV of recent prompts kept for reuse (shared prefixes); 0: off
    kv_storage: str = "auto"
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 32
    max_model_len: int = 4096
    decode_yields_to_prefill: str = "auto"  # auto | on | off; auto: on when the engine decodes on the CPU
    launch: bool = True  # start the engine and workers here; False: connect to the addresses below
    run_dir: str = ""  # where local sockets live; "" -> a fresh temporary directory
    engine_address: str = ""  # "" -> unix socket in run_dir
    worker_addresses: tuple[str, ...] = ()  # "" -> unix sockets in run_dir
    policy: str = ""  # policy file: filters, API keys, classes, degradation tiers; "" -> policies/default.toml
    limits: Limits = field(default_factory=Limits)
    log_level: str = "INFO"


CHOICES = {"kv_type": ("f16", "q8_0", "q4_0"), "device": ("auto", "cpu", "cuda"),
           "decode_yields_to_prefill": ("auto", "on", "off")}


def load_config(path: str | None, overrides: dict) -> ServeConfig:
    data = _read_toml(path) if path else {}
    limits = Limits(**_section(data.pop("limits", {}), Limits, path, "limits"))
    values = _section(data, ServeConfig, path, "")
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "worker_addresses" in values:
        values["worker_addresses"] = tuple(values["worker_addresses"])
    for key, allowed in CHOICES.items():
        if key in values and values[key] not in allowed:
            raise ConfigError(f"{path or 'command line'}: {key} = {values[key]!r}; expected one of {list(allowed)}")
    if path and values.get("policy") and not os.path.isabs(values["policy"]):
        values["policy"] = os.path.join(os.path.dirname(os.path.abspath(path)), values["policy"])
    return ServeConfig(**values, limits=limits)


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def _section(data: dict, cls, path: str | None, where: str) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {where or 'top level'} must be a table")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in known or key == "limits":
            raise ConfigError(f"{path}: unknown key {'.'.join(filter(None, [where, key]))!r}; "
                              f"known: {sorted(k for k in known if k != 'limits')}")
    return dict(data)


def policy_path(config: ServeConfig) -> str:
    return config.policy or str(Path(__file__).resolve().parent.parent / "policies" / "default.toml")


def default_threads(config: ServeConfig) -> int:
    return config.threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, config.prefill_workers))
