"""`edge serve`: start the gateway, the prefill workers and the decode engine from one command.
`edge check-model PATH.gguf`: say whether a GGUF is supported and fits, before serving it (edge/check_model/)."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from contracts.identity import UnsupportedModelError, check_supported
from contracts.model_kind import model_kind
from contracts.options import KNOBS
from contracts.startup_clock import since_start
from edge.config import ConfigError, load_config, policy_path
from edge.http.tls import TLSError, server_context
from policies.loader import PolicyError, load_policy
from prefill_cpu.embedded_model import embedded_model_path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="edge", description="On-prem OpenAI-compatible LLM service")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the service")
    serve.add_argument("--config", help="TOML config file (see docs/config.md)")
    add_serve_flags(serve)
    check = commands.add_parser("check-model", help="check a GGUF before serving it: support, sizes, fidelity")
    from edge.check_model.command import add_arguments  # the command's own flags live with it
    add_arguments(check)
    args = parser.parse_args(argv)
    if args.command == "check-model":
        from edge.check_model.command import run
        sys.exit(run(args))
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        config = load_config(args.config, overrides)
        load_policy(policy_path(config))  # refuse a bad policy before starting anything
        ssl_context = server_context(config)  # ... and bad TLS files, before the model loads
        model = config.model or embedded_model_path()
        if not model_kind(model).embedding:  # an embedding model is served without a handoff (no engine)
            check_supported(model)  # ... and a model family the handoff cannot carry
    except (ConfigError, PolicyError, TLSError, UnsupportedModelError, FileNotFoundError) as err:
        sys.exit(f"edge: {err}")
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s [gateway] %(name)s: %(message)s")
    logging.getLogger("edge").info("gateway: config, policy and model checked %.1f s after the process started",
                                   since_start())
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
                # a new or idle connection must send its headers in time
                keepalive_timeout=config.limits.header_timeout_s,
                print=lambda msg: logging.getLogger("edge").info(msg.strip()))


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per knob that `edge serve` takes on its command line, with the knob's type, choices and help; unset
    (None), the config file's value or the default stands."""
    for entry in KNOBS.values():
        if not entry.flag:
            continue
        name = "--" + entry.name.replace("_", "-")
        if entry.type is bool:
            parser.add_argument(name, action="store_true", default=None, help=entry.help)
        else:
            parser.add_argument(name, type=entry.type, choices=entry.choices or None, help=entry.help,
                                metavar=entry.metavar)


if __name__ == "__main__":
    main()
