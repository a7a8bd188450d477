"""The one typed config the launcher hands each child process: the decode engine's and a prefill worker's.

`edge serve` (edge.launch.launcher) builds it from the serve config and passes it whole, as JSON in one argument:
`python -m decode_gpu.service.server --config-json '{...}'`. The child decodes it (msgspec checks every field's
type) and checks every setting against its knob (contracts.options), so a child cannot disagree with the gateway
about what a setting allows. Started by hand for debugging, a child takes the same fields as flags instead
(`--model M.gguf --listen unix:/tmp/e.sock --max-num-seqs 8`; `--help` lists them), checked the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from contracts import control_tls
from contracts.control_tls import ControlTLS
from contracts.framing import refuse_plaintext_links
from contracts.options import AUTO, OptionError, check, field_knob, knob

CONFIG_FLAG = "--config-json"  # followed by the whole config; what the launcher passes


def wiring(help: str, default: Any = dataclasses.MISSING) -> Any:
    """A field that is no setting but where this process sits (its model file, its socket): not checked."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineProcessConfig:
    model: str = wiring("GGUF path")
    listen: str = wiring("unix:/path or tcp://host:port")
    cpu_share_file: str = wiring("decoding on the CPU, publish whether it decodes in this file, for prefill workers "
                                 "on the same cores (edge serve passes one in its run directory)", "")
    device: str = knob("device")
    dtype: str = knob("dtype")
    weight_dtype: str = knob("weight_dtype")
    kv_storage: str = knob("kv_storage")
    kv_cache_tokens: int | None = knob("kv_cache_tokens")
    gpu_memory_utilization: float = knob("gpu_memory_utilization")
    enforce_eager: bool = knob("enforce_eager")
    decode_forward: str = knob("decode_forward")
    deterministic: bool = knob("deterministic")
    block_size: int = knob("block_size")
    max_num_seqs: int = knob("max_num_seqs")
    max_model_len: int = knob("max_model_len")
    decode_yields_to_prefill: str = knob("decode_yields_to_prefill")
    max_backlog_bytes: int = knob("max_backlog_bytes")
    swap_space_gib: float = knob("swap_space_gib")
    kv_return_bytes: int = knob("kv_return_bytes")
    max_gateway_queue_bytes: int = knob("max_gateway_queue_bytes")
    cpu_decode_pace_ms: float = knob("cpu_decode_pace_ms")
    speculative: str = knob("speculative")
    num_speculative_tokens: int = knob("num_speculative_tokens")
    preemption_mode: str = knob("preemption_mode")
    prefix_caching: bool = knob("prefix_caching")
    log_level: str = knob("log_level")
    control_tls_certfile: str = knob("control_tls_certfile")
    control_tls_keyfile: str = knob("control_tls_keyfile")
    control_tls_ca: str = knob("control_tls_ca")
    allow_plaintext_control: bool = knob("allow_plaintext_control")
    control_handshake_timeout_s: float = knob("control_handshake_timeout_s")
    weight_second_set: bool = wiring("weight_dtype auto may hold the float set beside the quantized one (the memory "
                                     "plan, contracts/memory_plan.py)", True)
    weight_float_set: bool = wiring("weight_dtype auto may hold float weights at all (the memory plan)", True)
    weight_repack: bool = wiring("the GGUF's own blocks, where served, repacked by llama.cpp's CPU repack into the "
                                 "engine's memory (the memory plan made room for it)", False)


@dataclass(frozen=True)
class WorkerProcessConfig:
    model: str = wiring("GGUF path")
    listen: str = wiring("unix:/path or tcp://host:port")
    engine: str = wiring("the decode engine to hand off to unless a job names another; \"\": every job names it", "")
    name: str = wiring("the worker's name in logs and at the gateway", "prefill-0")
    cpu_share_file: str = wiring("the decode engine's CPU share file (edge serve passes it): half the threads while "
                                 "the engine decodes on the same cores", "")
    n_ctx: int = knob("n_ctx")
    n_batch: int = knob("n_batch")
    threads_per_worker: int = knob("threads_per_worker")
    # the launcher resolves auto (edge.config.worker_kv_type); a worker started by hand hands off across hosts
    kv_type: str = knob("kv_type", default="q8_0", exclude=(AUTO,))
    extra_kv_types: tuple[str, ...] | None = knob("extra_kv_types")
    prefill_weights: str = knob("prefill_weights")
    prefix_cache_tokens: int = knob("prefix_cache_tokens")
    kv_disk_bytes: int = knob("kv_disk_bytes")
    kv_disk_dir: str = knob("kv_disk_dir")
    log_level: str = knob("log_level")
    control_tls_certfile: str = knob("control_tls_certfile")
    control_tls_keyfile: str = knob("control_tls_keyfile")
    control_tls_ca: str = knob("control_tls_ca")
    allow_plaintext_control: bool = knob("allow_plaintext_control")
    control_handshake_timeout_s: float = knob("control_handshake_timeout_s")
    prefill_copy_kinds: tuple[str, ...] | None = wiring("the copies prefill_weights auto may measure, best first, "
                                                        "as the memory plan leaves room (None: auto's own rule)", None)


Config = TypeVar("Config", EngineProcessConfig, WorkerProcessConfig)


def encode_config(config: EngineProcessConfig | WorkerProcessConfig) -> str:
    return msgspec.json.encode(config).decode()


def decode_config(cls: type[Config], text: str | bytes) -> Config:
    """The config, every field type-checked and every setting checked; OptionError (a ValueError) otherwise."""
    try:
        config = msgspec.json.decode(text, type=cls)
    except msgspec.ValidationError as err:  # "Expected `int`, got `str` - at `$.max_num_seqs`"
        raise OptionError([("(config)", str(err))]) from None
    return check(config)


def config_argv(config: EngineProcessConfig | WorkerProcessConfig) -> list[str]:
    """The child's command-line arguments: the whole config in one."""
    return [CONFIG_FLAG, encode_config(config)]


def parse_config(cls: type[Config], argv: list[str], description: str) -> Config:
    """The child's config from its arguments: the launcher's one JSON argument, or flags typed by hand. A setting
    outside its knob's choices or bounds ends the process with the knob named. The process's control TLS is set
    here (contracts.control_tls), before anything loads, so a bad certificate file, or plain TCP off loopback
    without allow_plaintext_control, ends it the same way."""
    try:
        if argv[:1] == [CONFIG_FLAG]:
            if len(argv) != 2:
                raise SystemExit(f"{CONFIG_FLAG} takes the whole config: no other arguments")
            config = decode_config(cls, argv[1])
        else:
            flags = vars(hand_parser(cls, description).parse_args(argv))
            config = check(cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in flags.items()}))
        control_tls.configure(ControlTLS.of(config))
        refuse_plaintext_links(a for a in (config.listen, getattr(config, "engine", "")) if a.startswith("tcp://"))
        return config
    except (OptionError, ValueError) as err:
        raise SystemExit(f"{cls.__name__}: {err}") from None


def hand_parser(cls: type, description: str) -> argparse.ArgumentParser:
    """A flag per field (--max-num-seqs), with the knob's choices and help."""
    parser = argparse.ArgumentParser(description=description, epilog=f"{CONFIG_FLAG} JSON instead of the flags: "
                                     "the whole config in one argument, as edge serve passes it")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **_flag(f, hints[f.name]))
    return parser


def _flag(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    entry, exclude = field_knob(f)
    spec: dict[str, Any] = {"help": entry.help if entry else f.metadata["help"]}
    if f.default is dataclasses.MISSING:
        spec["required"] = True
    else:
        spec["default"] = f.default
    kind = next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    kind = typing.get_origin(kind) or kind
    if kind is bool:
        return {**spec, "action": argparse.BooleanOptionalAction}
    if kind is tuple:
        spec.update(nargs="*", type=str)
    else:
        spec["type"] = kind
    if entry and entry.allowed(exclude):
        spec["choices"] = entry.allowed(exclude)
    return spec
