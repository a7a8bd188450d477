"""`edge serve`: start the gateway, the prefill workers and the decode engine from one command.
`edge check-model PATH.gguf`: say whether a GGUF is supported and fits, before serving it (edge/check_model.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from contracts.identity import UnsupportedModelError, check_supported
from edge.config import ConfigError, load_config, policy_path
from edge.tls import TLSError, server_context
from policies.loader import PolicyError, load_policy
from prefill_cpu.embedded_model import embedded_model_path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="edge", description="On-prem OpenAI-compatible LLM service")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the service")
    serve.add_argument("--config", help="TOML config file (see docs/config.md)")
    serve.add_argument("--model", help="GGUF path (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--prefill-workers", type=int)
    serve.add_argument("--policy", help="policy file")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"])
    serve.add_argument("--kv-type", choices=["auto", "f16", "q8_0", "q4_0"],
                       help="handoff KV type (auto: f16 for workers next to the engine, q8_0 across hosts)")
    serve.add_argument("--prefill-weights", choices=["auto", "given", "f16", "bf16", "q8_0"],
                       help="what the prefill workers' llama.cpp loads: the GGUF as given or a copy converted once "
                            "(auto: f16 when a measurement says it prefills faster; docs/config.md)")
    serve.add_argument("--kv-cache-tokens", type=int)
    serve.add_argument("--weight-dtype", choices=["auto", "bfloat16", "float16", "float32", "int8", "int4", "q8_0"],
                       help="decode weights: int8/int4 weight-only quantization, q8_0 on ggml's CPU kernels, or float "
                            "(auto: the GGUF's quantization on CUDA, a measurement on the CPU; docs/decode.md)")
    serve.add_argument("--speculative", choices=["off", "ngram"],
                       help="speculative decoding: ngram drafts from the prompt and output, verified in one forward "
                            "(greedy and seeded outputs unchanged; docs/decode.md)")
    serve.add_argument("--num-speculative-tokens", type=int, help="draft tokens per sequence and step at most")
    serve.add_argument("--preemption-mode", choices=["swap", "recompute"],
                       help="a preempted decode sequence's KV: to host memory (swap) or prefilled again on a worker")
    serve.add_argument("--kv-storage", choices=["auto", "float32", "float16", "bfloat16", "int8", "int4"],
                       help="decode KV pool storage (int4: 0.59x int8's bytes, lower fidelity; docs/decode.md)")
    serve.add_argument("--enforce-eager", action="store_true", default=None,
                       help="no CUDA graphs in the decode step (slower; for debugging a GPU problem)")
    serve.add_argument("--ssl-certfile", help="PEM certificate: serve HTTPS (vLLM's flag names)")
    serve.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    serve.add_argument("--ssl-ca-certs", help="CA bundle: require client certificates it signed (mutual TLS)")
    serve.add_argument("--audit-log", help="file for one JSON line per request (docs/audit.md)")
    serve.add_argument("--otlp-traces-endpoint", help="export OpenTelemetry request traces over OTLP to this URL")
    serve.add_argument("--ray", metavar="auto|ADDRESS",
                       help="run the prefill workers and decode engines as actors of this Ray cluster (docs/cluster.md)")
    serve.add_argument("--log-level")
    check = commands.add_parser("check-model", help="check a GGUF before serving it: support, sizes, fidelity")
    from edge.check_model import add_arguments  # the command's own flags live with it
    add_arguments(check)
    args = parser.parse_args(argv)
    if args.command == "check-model":
        from edge.check_model import run
        sys.exit(run(args))
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        config = load_config(args.config, overrides)
        load_policy(policy_path(config))  # refuse a bad policy before starting anything
        ssl_context = server_context(config)  # ... and bad TLS files, before the model loads
        check_supported(config.model or embedded_model_path())  # ... and a model family the handoff cannot carry
    except (ConfigError, PolicyError, TLSError, UnsupportedModelError, FileNotFoundError) as err:
        sys.exit(f"edge: {err}")
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s [gateway] %(name)s: %(message)s")
    if config.ssl_ca_certs:
        logging.getLogger("edge").info("mutual TLS: clients need a certificate signed by %s", config.ssl_ca_certs)
    from edge.app import make_app  # after logging is set up: loading the app logs
    try:
        app = make_app(config)
    except (ValueError, FileNotFoundError) as err:  # a bad secret file, TCP without a secret, no model
        sys.exit(f"edge: {err}")
    # with ssl_context, aiohttp's "Running on https://..." line below names the scheme clients must use
    web.run_app(app, host=config.host, port=config.port, ssl_context=ssl_context, handler_cancellation=True,
                shutdown_timeout=config.limits.shutdown_grace_s + 5,
                keepalive_timeout=config.limits.header_timeout_s,  # a new or idle connection must send its headers in time
                print=lambda msg: logging.getLogger("edge").info(msg.strip()))


if __name__ == "__main__":
    main()
