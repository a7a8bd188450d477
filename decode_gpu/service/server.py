"""The decode engine process: loads the model, listens for handoffs and aborts, streams token events.

    python -m decode_gpu.service.server --config-json '{"model": ..., "listen": ...}'   (what edge serve passes)
    python -m decode_gpu.service.server --model PATH.gguf --listen unix:/tmp/edge/engine.sock [--device auto]

Its settings are one EngineProcessConfig (contracts.process_config), checked against their knobs (contracts.options);
by hand, each is a flag of the same name.

The engine is built and stepped on one thread of its own (torch releases the GIL; `EngineThread`); an asyncio
loop owns the sockets (decode_gpu.service.engine_service). The engine listens only after the model is loaded, so a
successful connection means the engine is ready.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import signal
import sys
import threading

# transformers' config classes import its activations module and, through it, torch's distributed tensor ops (about
# 55 MB, no modeling code): imported with the engine's own code, so the memory account counts it with the libraries
import transformers.activations  # noqa: F401

from contracts.cpu_share import CpuShare
from contracts.framing import control_secret, start_server
from contracts.handoff import max_handoff_bytes
from contracts.identity import read_gguf_identity
from contracts.options import FLOAT_WEIGHT_DTYPES
from contracts.process_config import EngineProcessConfig, parse_config
from contracts.startup_clock import since_start
from decode_gpu.core.priority_gate import PriorityGate
from decode_gpu.core.scheduler import SchedulerConfig
from decode_gpu.core.speculative import SpecConfig
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.model.loader import eos_token_ids, load_tokenizer
from decode_gpu.model.native_decoder import resolve_forward
from decode_gpu.model.weight_quant import load_weights
from decode_gpu.runner.device import resolve_device, resolve_dtype
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from decode_gpu.service.engine_service import EngineService
from decode_gpu.service.memory import MemoryAccount, rss_bytes, trim_heap

log = logging.getLogger("decode_gpu.service.server")


def build_engine(config: EngineProcessConfig) -> DecodeEngine:
    config = deterministic_config(config)
    identity = read_gguf_identity(config.model)
    device = resolve_device(config.device)
    # float weights are the model's dtype (contracts.options refused a contradicting pair)
    float_weights = config.weight_dtype in FLOAT_WEIGHT_DTYPES
    dtype = resolve_dtype(config.weight_dtype if float_weights else config.dtype, device)
    spec = spec_config(config)
    rss_start = _rss_mib()
    runner_settings = runner_config(config, spec)
    model, weights = load_weights(identity, device, dtype, config.weight_dtype, spec.max_rows(config.max_num_seqs),
                                  fixed_precision=config.deterministic,
                                  serving=resolve_forward(runner_settings.forward) == "native",
                                  second_set=config.weight_second_set, float_set=config.weight_float_set,
                                  repack=config.weight_repack)
    trimmed = trim_heap()  # loading and quantizing freed more than the model holds: give it back
    rss_model = _rss_mib()
    weights_at = since_start()
    tokenizer = load_tokenizer(identity)
    # decode and llama.cpp prefill share the cores only when decode runs on the CPU
    yields = config.decode_yields_to_prefill == "on" or (config.decode_yields_to_prefill == "auto"
                                                         and device.type == "cpu")
    log.info("decode %s to more important prompts in prefill (decode_yields_to_prefill %s, device %s)",
             "yields" if yields else "does not yield", config.decode_yields_to_prefill, device)
    runner = ModelRunner(model, identity, runner_settings, device, PriorityGate(enabled=yields))
    scheduler = SchedulerConfig(max_num_seqs=config.max_num_seqs, prefix_caching=config.prefix_caching,
                                preemption_mode=config.preemption_mode)
    engine = EngineConfig(scheduler=scheduler, max_model_len=config.max_model_len,
                          max_backlog_bytes=config.max_backlog_bytes,
                          swap_space_bytes=int(config.swap_space_gib * 2**30), speculative=spec)
    built = DecodeEngine(runner, engine, tokenizer, eos_token_ids(tokenizer, model))
    trimmed += trim_heap()
    log.info("decode engine built: the weights ready %.1f s after the process started, the tokenizer, KV pool, step "
             "buffers and sampler %.1f s after them", weights_at, since_start() - weights_at)
    pool_mib = runner.pool.shape.bytes_per_block() * runner.pool.shape.num_blocks / 2**20
    log.info("engine memory (RSS, MiB): %.0f before the model; %.0f after it (weights held: %.0f, on %s); %.0f "
             "after the KV pool (%.0f, on %s; on the CPU resident as its blocks are used), the step buffers and the "
             "tokenizer; %.0f of freed loading buffers given back", rss_start, rss_model,
             weights.total_bytes / 2**20, device, _rss_mib(), pool_mib, device, trimmed / 2**20)
    return built


def _rss_mib() -> float:
    import psutil
    return psutil.Process().memory_info().rss / 2**20


def runner_config(config: EngineProcessConfig, spec: SpecConfig) -> RunnerConfig:
    return RunnerConfig(block_size=config.block_size, kv_storage=config.kv_storage,
                        kv_cache_tokens=config.kv_cache_tokens, gpu_memory_utilization=config.gpu_memory_utilization,
                        max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                        enforce_eager=config.enforce_eager,
                        num_speculative_tokens=spec.num_speculative_tokens if spec.enabled else 0,
                        forward=config.decode_forward, deterministic=config.deterministic)


def deterministic_config(config: EngineProcessConfig) -> EngineProcessConfig:
    """deterministic implies the native forward, swap preemption (a worker's recomputed KV is not the engine's) and
    no speculation (a verify step's multi-token query computes a position's logits otherwise than a plain step)."""
    if not config.deterministic:
        return config
    implied = {"decode_forward": "native", "preemption_mode": "swap", "speculative": "off"}
    overridden = {k: getattr(config, k) for k, v in implied.items() if getattr(config, k) != v}
    if overridden:
        log.warning("deterministic decoding: %s set to %s", ", ".join(f"{k} {v}" for k, v in overridden.items()),
                    ", ".join(implied[k] for k in overridden))
    return dataclasses.replace(config, **implied)


def spec_config(config: EngineProcessConfig) -> SpecConfig:
    try:
        return SpecConfig(method=config.speculative, num_speculative_tokens=config.num_speculative_tokens)
    except ValueError as err:
        raise SystemExit(f"speculative {config.speculative} num_speculative_tokens "
                         f"{config.num_speculative_tokens}: {err}") from None


class EngineThread:
    """The one thread of the process that runs torch: it builds the engine, then steps it. libgomp keeps a team of
    OpenMP threads for every thread that runs parallel ops, and once the process holds more of them than there are
    cores it stops spinning between parallel regions: a CPU step built on one thread and run on another took twice
    as long (docs/decode.md). A daemon, so that a step that hangs cannot keep the process alive."""

    def __init__(self, name: str = "engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def run(self, fn, *args) -> asyncio.Future:
        """fn(*args) on this thread, after the jobs submitted before it."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((done, fn, args))
        return asyncio.wrap_future(done)

    def _work(self) -> None:
        while True:
            done, fn, args = self._jobs.get()
            try:
                done.set_result(fn(*args))
            except BaseException as err:  # SystemExit from a configuration build_engine refuses, too
                done.set_exception(err)


async def serve(config: EngineProcessConfig, stop: asyncio.Event | None = None) -> None:
    """Until `stop` is set (by default: SIGINT or SIGTERM), or the engine thread ends on its own (an error)."""
    torch_thread = EngineThread()
    libraries = rss_bytes()  # before the model: Python, torch, transformers, our code
    engine = await torch_thread.run(build_engine, config)
    account = MemoryAccount(engine, libraries)
    loop = asyncio.get_running_loop()
    identity = engine.runner.identity
    max_frame = max_handoff_bytes(identity.n_layer, identity.num_kv_heads, identity.head_dim_k,
                                  identity.head_dim_v, config.max_model_len)
    # decode on the CPU shares the cores with local prefill workers: they use half their threads while it decodes
    # (only when the engine halves its own threads too, with decode_yields_to_prefill on: one side alone at half its
    # threads next to the other at all of them is the worst split, docs/decode.md)
    share = CpuShare(config.cpu_share_file) if config.cpu_share_file and engine.runner.shares_cpu else None
    pace_s = config.cpu_decode_pace_ms / 1e3 if share is not None else 0.0
    if pace_s:
        log.info("decode paces its steps to one every %.0f ms while prompts wait for a prefill worker",
                 config.cpu_decode_pace_ms)
    service = EngineService(engine, loop, control_secret(config.listen), max_frame, config.max_gateway_queue_bytes,
                            share, pace_s, account, kv_return_bytes=config.kv_return_bytes)
    stepping = torch_thread.run(service.run_engine)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    stepping.add_done_callback(lambda _: stop.set())  # an engine thread that died must not leave a deaf process
    server = await start_server(service.handle_connection, config.listen)
    stats_task = asyncio.create_task(service.publish_stats())
    log.info("decode engine ready on %s, %.1f s after the process started", config.listen, since_start())
    # the structured-output tables, in a thread of their own, once listening: their build holds the GIL for about
    # half a second (llguidance reads the vocabulary in Python), which before the listen delayed it as long
    engine.sampler.matchers.warm()
    await stop.wait()
    ended = stepping.done() and not service.stopping.is_set()
    log.info("decode engine stopping: aborting %d in-flight requests", len(engine.requests))
    service.stopping.set()
    await asyncio.wait([stepping], timeout=10)
    await service.flush(timeout_s=2.0)  # let the abort events reach the gateway
    stats_task.cancel()
    server.close()
    failure = stepping.exception() if stepping.done() else None
    if ended or failure is not None:  # the supervisor restarts an engine that exits with an error
        log.error("the decode engine's thread ended: %r", failure, exc_info=failure)
        raise SystemExit(f"the decode engine's thread ended: {failure!r}")


def parse_args(argv=None) -> EngineProcessConfig:
    """The launcher's one JSON argument, or flags typed by hand (`--help` lists them)."""
    return parse_config(EngineProcessConfig, sys.argv[1:] if argv is None else argv, "decode engine process")


def main(argv=None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    log.info("decode engine process: Python, torch, transformers and the engine's code loaded %.1f s after the "
             "process started", since_start())
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
