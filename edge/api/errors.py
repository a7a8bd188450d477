"""The OpenAI error a request is answered with when something past parsing refuses or fails it: the policy, a
prefill worker, the decode engine."""

from __future__ import annotations

from contracts.events import TokenEvent
from contracts.messages import PrefillFailed
from edge.api.openai_request import ApiError
from policies.enforcer import PolicyRejection

PREFILL_FAILURES = {  # worker failure kind -> (HTTP status, OpenAI error type, code)
    "prompt_too_long": (400, "invalid_request_error", "context_length_exceeded"),  # OpenAI's status and code
    "context_exceeded": (400, "invalid_request_error", "context_length_exceeded"),
    "bad_prompt": (400, "invalid_request_error", "invalid_prompt"),
    "worker_died": (503, "server_error", "prefill_worker_died"),
    "worker_stuck": (503, "server_error", "prefill_worker_stuck"),
    "engine_unavailable": (503, "server_error", "engine_unavailable"),
    "internal": (500, "server_error", "prefill_failed"),
    "cancelled": (499, "server_error", "cancelled"),
    "recompute_failed": (503, "server_error", "kv_cache_full"),  # a preempted request could not be prefilled again
    # a structured output the worker could not compile (contracts.grammar's codes)
    "invalid_structured_output": (400, "invalid_request_error", "invalid_structured_output"),
    "structured_output_too_complex": (400, "invalid_request_error", "structured_output_too_complex"),
    "structured_output_busy": (503, "server_error", "structured_output_busy"),
}


def prefill_error(failed: PrefillFailed, context_tokens: int = 0, prompt_param: str = "messages") -> ApiError:
    """context_tokens: what one request may hold (the model's context, or the KV pool if smaller), named in a
    too-long prompt's message beside the limit that refused it; prompt_param: the field the prompt came in."""
    status, error_type, code = PREFILL_FAILURES.get(failed.kind, (500, "server_error", failed.kind))
    message = failed.message
    if failed.kind == "prompt_too_long":
        context = f"this model's maximum context length is {context_tokens} tokens" if context_tokens else ""
        policy = f"prompts are limited to {failed.limit} tokens" if failed.limit < context_tokens - 1 else ""
        message = (f"{'; '.join(p for p in (context, policy) if p) or f'the limit is {failed.limit} tokens'}. "
                   f"However, your prompt has {failed.num_prompt_tokens} tokens; shorten it")
    param = {"prompt_too_long": prompt_param, "context_exceeded": "max_tokens"}.get(failed.kind)
    headers = {"Retry-After": "2"} if status == 503 else {}  # a worker or a compile pool is busy or restarting
    return ApiError(status, message, param, code, error_type, headers)


def decode_error(event: TokenEvent) -> ApiError:
    """A full or restarting engine is availability (503, retry shortly); anything else is a failure of this
    request (500)."""
    if event.error_code in ("engine_busy", "kv_cache_full", "engine_unavailable", "engine_unresponsive"):
        return ApiError(503, f"the decode engine cannot serve this request now: {event.error}",
                        error_type="server_error", code=event.error_code, headers={"Retry-After": "2"})
    return ApiError(500, f"decoding failed: {event.error}", error_type="server_error", code="decode_failed")


def model_not_found(name: str, available: list[str]) -> ApiError:
    """A model this server does not serve, or that the policy lets no one use: 404 on every route, as OpenAI answers
    (its SDK raises NotFoundError; Anthropic's shape says not_found_error)."""
    shown = repr(name) if len(name) <= 60 else repr(name[:57] + "...")
    return ApiError(404, f"the model {shown} does not exist here; available: {', '.join(available) or 'none'}",
                    "model", "model_not_found")


def policy_error(err: PolicyRejection) -> ApiError:
    error_type = {401: "authentication_error", 403: "content_policy_violation", 429: "rate_limit_error",
                  503: "server_error"}.get(err.status, "invalid_request_error")
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else {}
    return ApiError(err.status, err.message, err.param, err.code, error_type, headers)
