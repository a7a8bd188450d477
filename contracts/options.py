"""Every setting's allowed values, defined once: name, type, default, choices or bounds, and help.

The gateway's config file and flags (edge.config, edge.cli), `edge check-model`, and the typed configs the launcher
hands the decode engine and the prefill workers (contracts.process_config) all read them here. A dataclass field
takes its default and its check from a knob with `knob(name)`; `problems(obj)` checks every such field. It lives in
contracts because every process reads it and contracts imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contracts.kv_dtypes import KV_DTYPES


class OptionError(ValueError):
    """Settings that cannot be used: one line per problem, each naming the knob and what it allows."""

    def __init__(self, issues: list[tuple[str, str]]) -> None:
        self.issues = issues
        super().__init__("\n".join(f"{name}: {message}" for name, message in issues))


@dataclass(frozen=True)
class Knob:
    name: str
    type: type  # int, float, str, bool, or tuple (of str)
    default: Any
    help: str
    choices: tuple[str, ...] = ()  # the allowed values (of each item, for a tuple); () = any of its type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    flag: bool = False  # `edge serve` takes it as --name-with-dashes too
    metavar: str | None = None

    @property
    def bounds(self) -> dict[str, float]:
        """{"ge": 1, "le": 16}: what pydantic's Field takes, too."""
        return {key: getattr(self, key) for key in ("ge", "gt", "le") if getattr(self, key) is not None}

    def problem(self, value: Any, exclude: tuple[str, ...] = ()) -> str | None:
        """What is wrong with `value`, in the config file's words; None when it is allowed."""
        if value is None and self.default is None:
            return None
        if not _is_a(value, self.type):
            return f"expected {_TYPE_NAMES[self.type]}, got {type(value).__name__} {value!r}"
        items = value if self.type is tuple else (value,)
        allowed = self.allowed(exclude)
        if allowed and (bad := next((v for v in items if v not in allowed), None)) is not None:
            return f"expected one of {list(allowed)}, got {bad!r}"
        return next((f"expected a value {_SIGNS[key]} {limit}, got {value!r}" for key, limit in self.bounds.items()
                     if not _within(value, key, limit)), None)

    def allowed(self, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
        return tuple(c for c in self.choices if c not in exclude)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", tuple: "a list"}
_SIGNS = {"ge": ">=", "gt": ">", "le": "<="}


def _is_a(value: Any, kind: type) -> bool:
    if kind is float:  # an integer is a number; a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (tuple, list) if kind is tuple else kind)


def _within(value: float, key: str, limit: float) -> bool:
    return value >= limit if key == "ge" else value > limit if key == "gt" else value <= limit


FLOAT_WEIGHT_DTYPES = ("bfloat16", "float16", "float32")  # weight_dtype values that are the model's own dtype
KV_TYPES = tuple(KV_DTYPES)  # llama.cpp's KV cache and handoff formats
AUTO = "auto"  # the choice each process resolves for itself

_KNOBS = (
    # --- the model and the gateway ---
    Knob("model", str, None, "GGUF path (default: the embedded SmolLM2-135M-Instruct)", flag=True),
    Knob("model_name", str, "", 'the id clients send as "model"; "" = the GGUF file name without .gguf'),
    Knob("host", str, "127.0.0.1", "address the gateway listens on", flag=True),
    Knob("port", int, 8000, "port the gateway listens on", ge=0, le=65535, flag=True),
    Knob("ssl_certfile", str, "", "PEM certificate: serve HTTPS (vLLM's flag names)", flag=True),
    Knob("ssl_keyfile", str, "", "the certificate's private key (PEM)", flag=True),
    Knob("ssl_ca_certs", str, "", "CA bundle: require client certificates it signed (mutual TLS)", flag=True),
    Knob("allow_unauthenticated", bool, False, "serve on a non-loopback address with no API keys and no client "
         "certificates: anyone who reaches the port may use the model (docs/security.md)", flag=True),
    Knob("audit_log", str, "", "file for one JSON line per request (docs/audit.md)", flag=True),
    Knob("audit_log_max_bytes", int, 100 << 20, "the audit log rotates past this size", ge=4096),
    Knob("audit_log_backups", int, 5, "rotated audit files kept", ge=0),
    Knob("audit_log_keep_days", float, 7.0, "rotated audit files younger than this are kept past audit_log_backups, "
         "so that a burst of junk cannot rotate the record out (0: by count only)", ge=0),
    Knob("otlp_traces_endpoint", str, "", "export OpenTelemetry request traces over OTLP to this URL", flag=True),
    Knob("policy", str, "", "policy file; \"\" = policies/default.toml", flag=True),
    Knob("log_level", str, "INFO", "log level of every process",
         choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), flag=True),
    Knob("grammar_compile_timeout_s", float, 5.0, "time limit for compiling one structured-output grammar; past it "
         "the request gets 400 structured_output_too_complex", ge=0.1, le=300),
    Knob("grammar_compile_queue_per_key", int, 8, "structured-output compiles of one API key (one client address "
         "without keys) that wait, in order, behind its running one; past them, or past grammar_compile_timeout_s "
         "+ 0.5 s of waiting, 429 structured_output_compiles_per_key (0: a second concurrent compile is refused "
         "at once)",
         ge=0, le=256),
    Knob("tool_call_parser", str, AUTO, "the format the model writes tool calls in (auto: from the GGUF's chat "
         "template, else hermes; docs/structured_outputs.md)",
         choices=(AUTO, "hermes", "llama3_json", "mistral", "phi4_mini"), flag=True),
    Knob("reasoning_parser", str, AUTO, "how the model's thinking is told from its answer (auto: <think> tags when "
         "the chat template has them; none: never split)", choices=(AUTO, "think", "none"), flag=True),
    # --- prefill workers (llama.cpp) ---
    Knob("prefill_workers", int, 1, "llama.cpp prefill processes", ge=1, flag=True),
    Knob("threads_per_worker", int, 0, "threads of each prefill worker; 0 = cores / workers", ge=0),
    Knob("kv_type", str, AUTO, "handoff KV type (auto: f16 for workers next to the engine, q8_0 across hosts)",
         choices=(AUTO, *KV_TYPES), flag=True),
    Knob("extra_kv_types", tuple, None, "KV types that degraded requests may ask for, each a context built at "
         "startup on the same weights (default: q4_0 unless kv_type is q4_0)", choices=KV_TYPES),
    Knob("prefill_weights", str, AUTO, "what the prefill workers' llama.cpp loads: the GGUF as given or a copy "
         "converted once (auto: f16 when a measurement says it prefills faster; docs/config.md)",
         choices=(AUTO, "given", "f16", "bf16", "q8_0"), flag=True),
    Knob("n_ctx", int, 4096, "longest prompt a prefill worker can hold", ge=1),
    Knob("n_batch", int, 256, "prompt tokens per llama.cpp call", ge=1),
    Knob("prefix_cache_tokens", int, 8192, "per worker: KV of recent prompts kept for reuse, at most (and at most "
         "1/64 of the RAM's bytes, never below 2048 tokens for that: contracts/prompt_cache.py); 0 = off", ge=0),
    Knob("kv_disk_bytes", int, 0, "per worker: the prompt cache's disk tier, prompts' KV kept in files past "
         "evictions and restarts (least recently used deleted first); 0 = off", ge=0),
    Knob("kv_return_bytes", int, 64 << 20, "the decode engine: finished answers' KV (stop or length) copied out "
         "for the prompt cache of the worker that prefilled them, waiting to be encoded, at most; 0 = off", ge=0),
    Knob("kv_disk_dir", str, "", "the disk tier's root folder (one 0700 folder per model, KV type and worker "
         "inside); \"\": kv/ under the cache dir (EDGE_LLM_CACHE, else ~/.cache/edge-llm)"),
    Knob("worker_heartbeat_timeout_s", float, 5.0, "a prefill worker silent this long is declared stuck", gt=1),
    Knob("engine_heartbeat_timeout_s", float, 5.0, "a decode engine silent this long (its stats come every 0.5 s) is "
         "declared unresponsive: its requests end with a 503", gt=1),
    # --- the decode engine ---
    Knob("device", str, AUTO, "decode device (auto: CUDA if present)", choices=(AUTO, "cpu", "cuda"), flag=True),
    Knob("dtype", str, AUTO, "decode weights and activations (auto: bfloat16 on CUDA and bfloat16-capable CPUs)",
         choices=(AUTO, "float32", "bfloat16", "float16")),
    Knob("weight_dtype", str, AUTO, "decode weights: int8/int4 weight-only quantization, q8_0 on ggml's CPU kernels, "
         "gguf (the GGUF's own blocks, mmap'd, on ggml's CPU kernels: no second copy), or float (auto: the GGUF's "
         "quantization on CUDA, a measurement or the memory plan on the CPU; docs/decode.md)",
         choices=(AUTO, *FLOAT_WEIGHT_DTYPES, "int8", "int4", "q8_0", "gguf"), flag=True),
    Knob("kv_storage", str, AUTO, "decode KV pool storage (auto: the model's dtype; int4: 0.59x int8's bytes, lower "
         "fidelity; docs/decode.md)", choices=(AUTO, "float32", "float16", "bfloat16", "int8", "int4"), flag=True),
    Knob("kv_cache_tokens", int, None, "decode KV pool size in tokens (0 or unset: what the memory plan leaves on "
         "the CPU, what gpu_memory_utilization leaves on CUDA)", ge=0, flag=True),
    Knob("memory_budget", int, 0, "bytes the processes of edge serve may hold together, planned before anything "
         "loads (docs/sizes.md); a model that cannot fit is refused at start (0: 85% of the RAM on a CPU, 90% of the "
         "device's memory on CUDA)", ge=0, flag=True, metavar="BYTES"),
    Knob("keep_alive", str, "5m", "with [[models]]: how long a model stays loaded after its last request unless its "
         "table says (Ollama's meaning: \"30s\", \"5m\", \"1h\"; \"0\" unloads after the answer, \"-1\" keeps it; "
         "docs/models.md)"),
    Knob("model_load_timeout_s", float, 300.0, "with [[models]]: how long a request waits for its model to load (the "
         "wait counts in its TTFT); a load that takes longer fails (docs/models.md)", gt=0),
    Knob("gpu_memory_utilization", float, 0.9, "on CUDA without kv_cache_tokens: the engine's share of total GPU "
         "memory", gt=0, le=1),
    Knob("enforce_eager", bool, False, "no CUDA graphs in the decode step (slower; for debugging a GPU problem)",
         flag=True),
    Knob("decode_forward", str, "native", "the decode step's model code: our own (native) or transformers' with the "
         "paged attention plugged in (kept for comparison; docs/decode.md)", choices=("native", "transformers"),
         flag=True),
    Knob("deterministic", bool, False, "a sequence's tokens independent of the batch it shares and of preemption: "
         "fixed weight precision, batch-invariant reductions; implies the native forward, swap preemption and no "
         "speculation (slower; docs/decode.md)", flag=True),
    Knob("block_size", int, 16, "tokens per KV pool block", ge=1),
    Knob("max_num_seqs", int, 32, "sequences decoded together", ge=1),
    Knob("max_model_len", int, 4096, "prompt + output tokens of one request", ge=1),
    Knob("swap_space_gib", float, 4.0, "host memory for preempted decode sequences; 0 = no preemption by swap", ge=0),
    Knob("prefix_caching", bool, True, "decode requests whose prompts start alike share the prefix's KV blocks"),
    Knob("preemption_mode", str, "swap", "a preempted decode sequence's KV: to host memory (swap) or prefilled again "
         "on a worker (recompute)", choices=("swap", "recompute"), flag=True),
    Knob("speculative", str, "off", "speculative decoding: ngram drafts from the prompt and output, verified in one "
         "forward (greedy and seeded outputs unchanged; docs/decode.md)", choices=("off", "ngram"), flag=True),
    Knob("num_speculative_tokens", int, 4, "draft tokens per sequence and step at most", ge=1, le=16, flag=True),
    Knob("max_backlog_bytes", int, 512 << 20, "KV handoff bytes waiting for decode admission; beyond: 503 "
         "engine_busy", ge=1),
    Knob("max_gateway_queue_bytes", int, 32 << 20, "token events queued for one gateway connection; beyond it the "
         "connection is dropped", ge=1),
    Knob("decode_yields_to_prefill", str, AUTO, "lower-priority decode pauses while a more important prompt is "
         "prefilled (auto: on when decoding on the CPU)", choices=(AUTO, "on", "off")),
    Knob("cpu_decode_pace_ms", float, 0.0, "CPU decode beside local workers: one step at most every this many ms "
         "while prompts wait (0 = off)", ge=0),
    # --- where the processes run ---
    Knob("launch", bool, True, "start the engine and workers here; false: connect to the addresses given"),
    Knob("run_dir", str, "", 'where local sockets live; "" = a fresh temporary directory'),
    Knob("engine_address", str, "", 'unix:/path or tcp://host:port; "" = a socket in run_dir'),
    Knob("worker_addresses", tuple, (), "one address per prefill worker; [] = sockets in run_dir"),
    Knob("control_secret_file", str, "", "file holding the control sockets' shared secret; required for TCP"),
    Knob("control_tls_certfile", str, "", "PEM certificate every process presents on TCP control links (mutual TLS, "
         "with control_tls_keyfile and control_tls_ca; docs/security.md)"),
    Knob("control_tls_keyfile", str, "", "the control certificate's private key (PEM, unencrypted)"),
    Knob("control_tls_ca", str, "", "PEM CA that signs every control certificate; a peer it did not sign is refused"),
    Knob("allow_plaintext_control", bool, False, "allow TCP control links without TLS on or to addresses that are "
         "not loopback (frames readable and forgeable on the network)"),
    Knob("control_handshake_timeout_s", float, 5.0, "a control connection that has not passed the TLS and HMAC "
         "handshakes within this is closed", gt=0, le=60),
    Knob("ray", str, "", "run the prefill workers and decode engines as actors of this Ray cluster "
         "(docs/cluster.md)", flag=True, metavar="auto|ADDRESS"),
    Knob("decode_engines", int, 1, "with ray: decode engines, each needing one unit of ray_decode_resource", ge=1),
    Knob("ray_decode_resource", str, "GPU", "with ray: what each engine asks for (a custom resource on CPU-only "
         "clusters)"),
    Knob("ray_prefill_cpus", float, 0.0, "with ray: CPUs each prefill worker asks for; 0 = threads_per_worker, or 1",
         ge=0),
    # --- [limits] ---
    Knob("max_body_bytes", int, 1 << 20, "larger request bodies get 413", ge=1),
    Knob("default_max_tokens", int, 256, "when a request gives none (the policy caps what it may ask for)", ge=1),
    Knob("prefill_queue_size", int, 64, "waiting prompts beyond this get 429", ge=1),
    Knob("header_timeout_s", float, 10.0, "a client must send its headers within this", gt=0),
    Knob("body_timeout_s", float, 30.0, "... and its body within this", gt=0),
    Knob("request_timeout_s", float, 300.0, "overall deadline of one request", gt=0),
    Knob("shutdown_grace_s", float, 5.0, "on SIGTERM, in-flight requests may finish for this long", ge=0),
)
KNOBS: dict[str, Knob] = {k.name: k for k in _KNOBS}


def knob(name: str, default: Any = dataclasses.MISSING, exclude: tuple[str, ...] = ()) -> Any:
    """A dataclass field checked against knob `name`, with its default unless the class has its own (a prefill
    worker started by hand defaults to q8_0 KV); `exclude` narrows the choices (a worker's KV type is not auto)."""
    entry = KNOBS[name]
    return dataclasses.field(default=entry.default if default is dataclasses.MISSING else default,
                             metadata={"knob": name, "exclude": exclude})


def field_knob(f: dataclasses.Field) -> tuple[Knob | None, tuple[str, ...]]:
    """The knob a dataclass field reads (None for one that is no setting, e.g. where a child listens), and the
    choices it excludes."""
    name = f.metadata.get("knob")
    return (KNOBS[name] if name else None), f.metadata.get("exclude", ())


def problems(obj: Any) -> list[tuple[str, str]]:
    """(knob, what is wrong) for every field of the dataclass `obj` outside its knob's choices or bounds, and for
    every pair of settings that are allowed alone but not together."""
    found = []
    for f in dataclasses.fields(obj):
        entry, exclude = field_knob(f)
        message = entry.problem(getattr(obj, f.name), exclude) if entry else None
        if message:
            found.append((f.name, message))
    return found + conflicts({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})


def conflicts(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Settings each allowed alone but not together."""
    weights, dtype = values.get("weight_dtype"), values.get("dtype")
    if weights in FLOAT_WEIGHT_DTYPES and dtype not in (None, AUTO, weights):
        return [("weight_dtype", f"{weights} weights with dtype {dtype}: float weights are in the model's dtype; "
                                 f"set one of the two")]
    return []


def check(obj: Any) -> Any:
    """obj, if every setting in it is allowed; else OptionError naming each knob and what it allows."""
    found = problems(obj)
    if found:
        raise OptionError(found)
    return obj
