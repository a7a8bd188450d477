"""The decode engine process: loads the model, listens for handoffs and aborts, streams token events.

    python -m decode_gpu.service.server --model PATH.gguf --listen unix:/tmp/edge/engine.sock [--device auto]

The engine is built and stepped on one thread of its own (torch releases the GIL; `EngineThread`); an asyncio
loop owns the sockets (decode_gpu.service.engine_service). The engine listens only after the model is loaded, so a successful connection
means the engine is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import queue
import signal
import threading

from decode_gpu.core.backlog import DEFAULT_LIMIT_BYTES
from decode_gpu.runner.device import resolve_device, resolve_dtype
from decode_gpu.engine import DecodeEngine, EngineConfig
from decode_gpu.service.engine_service import EngineService
from decode_gpu.service.gateway_link import DEFAULT_QUEUE_BYTES
from decode_gpu.model.loader import eos_token_ids, load_tokenizer
from decode_gpu.runner.model_runner import ModelRunner, RunnerConfig
from decode_gpu.core.priority_gate import PriorityGate
from decode_gpu.core.scheduler import SchedulerConfig
from decode_gpu.core.speculative import METHODS, SpecConfig
from decode_gpu.model.weight_quant import FLOAT_WEIGHTS, WEIGHT_DTYPES, load_weights
from contracts.cpu_share import CpuShare
from contracts.framing import control_secret, start_server
from contracts.handoff import max_handoff_bytes
from contracts.identity import read_gguf_identity

log = logging.getLogger("decode_gpu.service.server")


def build_engine(args: argparse.Namespace) -> DecodeEngine:
    identity = read_gguf_identity(args.model)
    device = resolve_device(args.device)
    float_weights = args.weight_dtype in FLOAT_WEIGHTS
    if float_weights and args.dtype not in ("auto", args.weight_dtype):
        raise SystemExit(f"--weight-dtype {args.weight_dtype} with --dtype {args.dtype}: float weights are in the "
                         f"model's dtype; set one of the two")
    dtype = resolve_dtype(args.weight_dtype if float_weights else args.dtype, device)
    spec = spec_config(args)
    model, _ = load_weights(identity, device, dtype, args.weight_dtype, spec.max_rows(args.max_num_seqs))
    tokenizer = load_tokenizer(identity)
    # decode and llama.cpp prefill share the cores only when decode runs on the CPU
    yields = args.yield_to_prefill == "on" or (args.yield_to_prefill == "auto" and device.type == "cpu")
    log.info("decode %s to more important prompts in prefill (--yield-to-prefill %s, device %s)",
             "yields" if yields else "does not yield", args.yield_to_prefill, device)
    runner = ModelRunner(model, identity, RunnerConfig(block_size=args.block_size, kv_storage=args.kv_storage,
                                                       kv_cache_tokens=args.kv_cache_tokens,
                                                       gpu_memory_utilization=args.gpu_memory_utilization,
                                                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                                       enforce_eager=args.enforce_eager,
                                                       num_speculative_tokens=spec.num_speculative_tokens if spec.enabled else 0),
                         device, PriorityGate(enabled=yields))
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, prefix_caching=args.prefix_caching == "on",
                                preemption_mode=args.preemption_mode)
    config = EngineConfig(scheduler=scheduler, max_model_len=args.max_model_len,
                          max_backlog_bytes=args.max_backlog_bytes, swap_space_bytes=int(args.swap_space_gib * 2**30),
                          speculative=spec)
    return DecodeEngine(runner, config, tokenizer, eos_token_ids(tokenizer, model))


def spec_config(args: argparse.Namespace) -> SpecConfig:
    try:
        return SpecConfig(method=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
    except ValueError as err:
        raise SystemExit(f"--speculative {args.speculative} --num-speculative-tokens "
                         f"{args.num_speculative_tokens}: {err}") from None


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


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> None:
    """Until `stop` is set (by default: SIGINT or SIGTERM), or the engine thread ends on its own (an error)."""
    torch_thread = EngineThread()
    engine = await torch_thread.run(build_engine, args)
    loop = asyncio.get_running_loop()
    identity = engine.runner.identity
    max_frame = max_handoff_bytes(identity.n_layer, identity.num_kv_heads, identity.head_dim_k,
                                  identity.head_dim_v, args.max_model_len)
    # decode on the CPU shares the cores with local prefill workers: they use half their threads while it decodes
    # (only when the engine halves its own threads too, with --yield-to-prefill on: one side alone at half its
    # threads next to the other at all of them is the worst split, docs/decode.md)
    share = CpuShare(args.cpu_share_file) if args.cpu_share_file and engine.runner.shares_cpu else None
    pace_s = args.cpu_decode_pace_ms / 1e3 if share is not None else 0.0
    if pace_s:
        log.info("decode paces its steps to one every %.0f ms while prompts wait for a prefill worker",
                 args.cpu_decode_pace_ms)
    service = EngineService(engine, loop, control_secret(args.listen), max_frame, args.max_gateway_queue_bytes, share,
                            pace_s)
    stepping = torch_thread.run(service.run_engine)
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    stepping.add_done_callback(lambda _: stop.set())  # an engine thread that died must not leave a deaf process
    server = await start_server(service.handle_connection, args.listen)
    stats_task = asyncio.create_task(service.publish_stats())
    log.info("decode engine ready on %s", args.listen)
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="decode engine process")
    parser.add_argument("--model", required=True)
    parser.add_argument("--listen", required=True, help="unix:/path or tcp://host:port")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES,
                        help="linear weights: int8 or int4 weight-only quantization, or a float dtype (= --dtype); "
                             "auto: the GGUF's quantization on CUDA, a measurement on the CPU")
    parser.add_argument("--kv-storage", default="auto", help="auto, float32, float16, bfloat16, int8 or int4")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on CUDA without --kv-cache-tokens: the share of the GPU's total memory this engine may "
                             "use (weights, activations and the KV pool)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: run every decode step eagerly (slower on a GPU; for debugging)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--yield-to-prefill", default="auto", choices=["auto", "on", "off"],
                        help="pause lower-priority decode while a more important prompt is prefilled "
                             "(auto: on when decoding on the CPU, which prefill shares)")
    parser.add_argument("--max-backlog-bytes", type=int, default=DEFAULT_LIMIT_BYTES,
                        help="KV bytes of handoffs accepted but not yet in the pool; beyond it a handoff is refused "
                             "at once (an empty backlog still takes one handoff of any size)")
    parser.add_argument("--swap-space-gib", type=float, default=4.0,
                        help="host memory for the KV of preempted sequences; when full, a waiter does not preempt "
                             "and a sequence that must give up its blocks fails (0: no preemption)")
    parser.add_argument("--max-gateway-queue-bytes", type=int, default=DEFAULT_QUEUE_BYTES,
                        help="token events queued for one gateway connection; beyond it the connection is dropped")
    parser.add_argument("--cpu-decode-pace-ms", type=float, default=0.0,
                        help="decoding on the CPU next to local prefill workers (--cpu-share-file): while prompts wait "
                             "for a busy worker, start a step at most every this many ms (0: off; a TPOT budget that "
                             "leaves the cores to prefill and batches more sequences a step, docs/config.md)")
    parser.add_argument("--cpu-share-file", default="",
                        help="decoding on the CPU, publish whether it decodes in this file, for prefill workers on the "
                             "same cores (edge serve passes one in its run directory)")
    parser.add_argument("--speculative", default="off", choices=METHODS,
                        help="speculative decoding: ngram proposes drafts by prompt lookup (the last tokens' earlier "
                             "occurrence in the prompt or output) and verifies them in one multi-token forward; greedy "
                             "and seeded outputs are unchanged. A sequence whose drafts keep failing stops proposing")
    parser.add_argument("--num-speculative-tokens", type=int, default=4,
                        help="draft tokens verified per sequence and step at most (with --speculative ngram)")
    parser.add_argument("--preemption-mode", default="swap", choices=["swap", "recompute"],
                        help="a preempted sequence's KV: copied to host memory (swap), or freed and prefilled again by "
                             "a prefill worker at its priority (recompute; needs the gateway, which sends it back)")
    parser.add_argument("--prefix-caching", default="on", choices=["on", "off"],
                        help="requests whose prompts start alike share the full KV blocks of the common prefix")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
