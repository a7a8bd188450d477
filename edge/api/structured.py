"""Structured-output constraints in a request: which field asked for one (OpenAI's response_format, vLLM's
guided_* fields and structured_outputs object), and the gateway's check that the engine can enforce it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from edge.api.fields import ApiError, checked_text, get_field, show

if TYPE_CHECKING:
    from edge.api.generate_request import GenerateRequest

COMPILE_PROCESSES = 2  # the gateway's compile processes (each takes one core while it compiles)
COMPILES_PER_OWNER = 1  # of them, at most this many for one API key (or one client address without keys); the
# key's further compiles wait their turn (grammar_compile_queue_per_key of them, within the time limit)


class GrammarChecks:
    """The gateway's compile processes: one contracts.grammar_compile.GatewayCheck per model file, made on its first
    constraint (or by warm); held under edge.state.GRAMMAR_CHECKS."""

    def __init__(self) -> None:
        self.checks: dict = {}  # model path (None: no vocabulary) -> GatewayCheck

    def check(self, model_path: str | None, queue_per_key: int | None = None):
        from contracts.compile_processes import CompileProcesses
        from contracts.grammar_compile import GatewayCheck
        check = self.checks.get(model_path)
        if check is None:
            vocabulary = "prefill_cpu.grammar:GGUFVocabulary" if model_path else None
            check = self.checks[model_path] = GatewayCheck(CompileProcesses(
                COMPILE_PROCESSES, COMPILES_PER_OWNER, vocabulary, model_path or ""))
        if queue_per_key is not None:  # the config's (the route passes it with each check)
            check.processes.queue_per_owner = queue_per_key
        return check

    def warm(self, model_path: str | None) -> None:
        """Start the compile processes now (each loads the model's vocabulary, a second or two), so that the first
        structured request does not wait for them."""
        self.check(model_path).processes.warm()

    def state(self) -> dict:
        """For /health: the compile processes (running, waiting for a process, waiting their key's turn, stopped so
        far, compiles sent to them so far), over all models."""
        states = [check.processes.state() for check in self.checks.values()]
        return {name: sum(state[name] for state in states)
                for name in ("idle", "compiling", "waiting", "queued", "stopped", "compiles")}

    def close(self) -> None:
        """Stop every compile (at shutdown): the requests awaiting them end at once."""
        for check in self.checks.values():
            check.close()
        self.checks.clear()


async def check_structured(request: GenerateRequest, checks: GrammarChecks, timeout_s: float | None = None,
                           model_path: str | None = None, owner: str | None = None,
                           queue_per_key: int | None = None, cache_salt: str = "") -> None:
    """A constraint the engine cannot enforce is the client's 400 naming the problem (code
    invalid_structured_output), one too large or too slow to compile a 400 too (code structured_output_too_complex),
    a client whose compiles already fill its queue, or whose turn does not come within the limit, a 429
    (structured_output_compiles_per_key), and no process free within the limit a 503 (structured_output_busy). The
    constraint is compiled as the prefill workers will compile it, over the model's vocabulary (the GGUF at
    model_path, its tokenizer only), in one of checks' child processes that is killed at timeout_s
    (grammar_compile_timeout_s) or when the client goes away (this task cancelled, which also takes a waiting
    compile out of its key's queue). owner: whose share the compile takes (compile_owner). queue_per_key:
    grammar_compile_queue_per_key (None: the knob's default). cache_salt: the request's (Gateway.cache_salt): the
    outcome is kept for that salt alone, so a schema another tenant sent before is compiled again, not answered at
    once."""
    constraint = request.sampling.structured
    if constraint is None:
        return
    from contracts.grammar import GrammarBusyError, GrammarError, GrammarOwnerBusyError
    from contracts.grammar_compile import compile_timeout_s
    try:
        await checks.check(model_path, queue_per_key).check(*constraint, timeout_s or compile_timeout_s(), owner,
                                                            cache_salt)
    except GrammarOwnerBusyError as err:
        raise ApiError(429, str(err), request.structured_param, err.code, "rate_limit_error",
                       {"Retry-After": "1"}) from None
    except GrammarBusyError as err:
        raise ApiError(503, str(err), request.structured_param, err.code, "server_error",
                       {"Retry-After": "1"}) from None
    except GrammarError as err:
        raise ApiError(400, str(err), request.structured_param, err.code) from None


def compile_owner(key_id: str | None, address: str | None) -> str:
    """Whose share of the compile processes a request takes: its API key, or without keys its client address."""
    return f"key:{key_id}" if key_id else f"address:{address or ''}"


def structured_constraint(body: dict) -> tuple[str | None, tuple[str, str] | None]:
    """(the field it came from, (kind, source)) of a structured-output constraint, or (None, None). OpenAI's
    response_format, vLLM's guided_* fields and its structured_outputs object; at most one constraint. Whether
    it compiles is checked by the caller (check_structured, off the event loop)."""
    found: list[tuple[str, tuple[str, str]]] = []
    response_format = get_field(body, "response_format", dict, default=None)
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            found.append(("response_format", ("json_object", "")))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                               "response_format", "invalid_value")
            found.append(("response_format", json_schema(schema, "response_format.json_schema.schema",
                                                         "response_format")))
        elif kind != "text":
            raise ApiError(400, f"response_format.type must be text, json_object or json_schema, not "
                                f"{show(kind)}", "response_format", "invalid_value")
    sources = {f"guided_{name}": body.get(f"guided_{name}") for name in ("json", "regex", "choice", "grammar")}
    outputs = get_field(body, "structured_outputs", dict, default={})
    sources.update({f"structured_outputs.{name}": outputs.get(name) for name in ("json", "regex", "choice", "grammar")})
    for param, value in sources.items():
        if value is not None:
            found.append((param, _guided(param, value)))
    if len(found) > 1:
        raise ApiError(400, f"one structured output per request, got {', '.join(p for p, _ in found)}", found[1][0],
                       "invalid_value")
    return found[0] if found else (None, None)


def json_schema(schema: dict, field: str, param: str | None = None) -> tuple[str, str]:
    """A schema object as a json_schema constraint. Its depth is checked before json.dumps, which recurses: a schema
    nested past contracts.grammar.MAX_SCHEMA_DEPTH is a 400 naming field (param: the error's field, if another)."""
    from contracts.grammar import GrammarError, check_schema_depth
    try:
        check_schema_depth(schema, field)
    except GrammarError as err:
        raise ApiError(400, str(err), param or field, err.code) from None
    return "json_schema", json.dumps(schema)


def _guided(param: str, value) -> tuple[str, str]:
    kind = param.rsplit("_", 1)[-1].rsplit(".", 1)[-1]
    if kind == "json":
        if isinstance(value, str):
            return "json_schema", value
        if isinstance(value, dict):
            return json_schema(value, param)
        raise ApiError(400, f"{param} must be a JSON schema (an object or its JSON text)", param, "invalid_type")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, f"{param} must be a non-empty list of non-empty strings", param, "invalid_value")
        return "choice", json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param, "invalid_type")
    return kind, checked_text(value, param)
