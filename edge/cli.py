"""`edge serve`: start the gateway, the prefill workers and the decode engine from one command.
`edge check-model PATH.gguf`: say whether a GGUF is supported and fits, before serving it (edge/check_model/)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import sys
import threading
import time

from aiohttp import web
from aiohttp.web_runner import GracefulExit

from contracts.gguf_check import check_gguf
from contracts.gguf_header import GGUFError
from contracts.identity import UnsupportedModelError, check_supported
from contracts.memory_plan import MemoryPlan, MemoryRefused
from contracts.model_kind import model_kind
from contracts.options import KNOBS
from contracts.startup_clock import since_start
from edge.check_model.memory import NoDeviceMemory, machine, planned_config, serve_plan
from edge.config import ConfigError, load_config, open_without_authentication, policy_path
from edge.http.tls import TLSError, server_context
from edge.observe.process_memory import MEMORY_PLAN, MEMORY_REPORTS, MemoryReport
from policies.loader import PolicyError, load_policy
from prefill_cpu.embedded_model import embedded_model_path

ALLOW_OPEN_FLAG = "--allow-unauthenticated"


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
        policy = load_policy(policy_path(config))  # refuse a bad policy before starting anything
        ssl_context = server_context(config)  # ... and bad TLS files, before the model loads
        plan = None
        if not config.models:  # with [[models]] each model is checked and planned as it loads: a bad one fails alone
            config, plan = _checked_model(config)
    except (ConfigError, PolicyError, TLSError, UnsupportedModelError, GGUFError, FileNotFoundError,
            MemoryRefused, NoDeviceMemory) as err:
        sys.exit(f"edge: {err}")
    open_to = open_without_authentication(config, policy)
    if open_to and not config.allow_unauthenticated:
        sys.exit(f"edge: refusing to serve on {open_to} with no API keys in the policy ({policy.source}) and no "
                 f"client certificates (ssl_ca_certs): anyone who reaches the port could use the model. Add keys "
                 f"(docs/policies.md), listen on 127.0.0.1, or pass {ALLOW_OPEN_FLAG} (allow_unauthenticated = true "
                 "in the config) to serve it open on purpose "
                 "(docs/security.md)")
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s [gateway] %(name)s: %(message)s")
    logging.getLogger("edge").info("gateway: config, policy and model checked %.1f s after the process started",
                                   since_start())
    if plan is not None:
        logging.getLogger("edge").info("memory plan (memory_budget %d; docs/sizes.md):\n%s", config.memory_budget,
                                       plan[0].describe())
    if open_to:
        logging.getLogger("edge").warning("OPEN SERVICE: listening on %s with NO AUTHENTICATION (no API keys, no "
                                          "client certificates; %s given): anyone who reaches this port can use the "
                                          "model", open_to, ALLOW_OPEN_FLAG)
    if config.ssl_ca_certs:
        logging.getLogger("edge").info("mutual TLS: clients need a certificate signed by %s", config.ssl_ca_certs)
    from edge.app import make_app  # after logging is set up: loading the app logs
    try:
        app = make_app(config)
    except (ValueError, FileNotFoundError) as err:  # a bad secret file, TCP without a secret, no model
        sys.exit(f"edge: {err}")
    if plan is not None:  # /health shows each process's memory against it (edge.observe.process_memory)
        app[MEMORY_PLAN], app[MEMORY_REPORTS] = plan[0], MemoryReport()
    supervisor = _supervise_start(app, config)
    # with ssl_context, aiohttp's "Running on https://..." line below names the scheme clients must use
    web.run_app(app, host=config.host, port=config.port, ssl_context=ssl_context, handler_cancellation=True,
                shutdown_timeout=config.limits.shutdown_grace_s + 5,
                # a new or idle connection must send its headers in time
                keepalive_timeout=config.limits.header_timeout_s,
                print=lambda msg: logging.getLogger("edge").info(msg.strip()))
    if supervisor is not None and supervisor.start_failure:
        sys.exit(f"edge: the start failed: {supervisor.start_failure}")


EXIT_BOUND_S = 10.0  # after the drain and the children's stop, the interpreter's own exit takes at most this


def command() -> None:
    """`edge` as a process (the console script, `python -m edge.cli`): main(), then the process's exit bounded. Not
    in main() itself: a caller in the same process (a test) must never be ended by the watchdog."""
    code = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        raise
    finally:
        _exit_within(EXIT_BOUND_S, code)


def _exit_within(seconds: float, code: int) -> None:
    """The drain is over and the children are stopped; what is left is the interpreter's exit, which joins every
    non-daemon thread (an executor's worker still blocked in a call, a library's thread) and runs atexit hooks. A
    thread that never returns would hold the process past SIGTERM's bound, so a watchdog ends it: past `seconds`
    it writes every thread's stack to stderr (the log says what held it) and exits with `code`."""
    def watchdog() -> None:
        time.sleep(seconds)
        logging.getLogger("edge").error("the process did not exit within %.0f s of its shutdown; the threads "
                                        "that held it:", seconds)
        faulthandler.dump_traceback(all_threads=True)
        logging.shutdown()
        os._exit(code)
    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def _checked_model(config):
    """The single model checked before anything starts: a corrupt or hostile file, a family the handoff cannot carry,
    a model that cannot fit the box's memory; the config with the plan's decisions, and the plan (None: none made)."""
    model = config.model or embedded_model_path()
    check_gguf(model)  # a corrupt or hostile model file, before any process reads it
    embedding = model_kind(model).embedding
    if not embedding:  # an embedding model is served without a handoff (no engine)
        check_supported(model)
    plan = _plan(config, model) if config.launch and not config.ray and not embedding else None
    return (config if plan is None else plan[1]), plan


def _plan(config, model: str) -> tuple[MemoryPlan, object]:
    """The memory plan of this start, and the config with its decisions (MemoryRefused: it cannot fit)."""
    box = machine(config.device)
    plan = serve_plan(config, model, box)
    return plan, planned_config(config, plan, box)


def _supervise_start(app: web.Application, config):
    """The launched children's supervisor, told which of them the gateway has seen ready, and to end the gateway
    when one fails its start for good (it died at each try before it was ever ready: a model llama.cpp aborts on);
    its children stop within the drain time. None without launched children (launch = false, ray)."""
    from edge.launch.launcher import ready_probe
    from edge.state import GATEWAY, SUPERVISOR
    supervisor = app.get(SUPERVISOR)
    if supervisor is None:
        return None
    supervisor.is_ready = ready_probe(app[GATEWAY])
    supervisor.on_start_failed = lambda reason: asyncio.get_running_loop().call_soon(_graceful_exit)
    supervisor.stop_timeout_s = max(1.0, config.limits.shutdown_grace_s)
    return supervisor


def _graceful_exit() -> None:
    raise GracefulExit()  # what aiohttp's SIGTERM handler raises: run_app then runs its shutdown sequence


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
    command()
