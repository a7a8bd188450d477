"""DELETE /v1/kv_cache: an operator deletes one tenant's cached prompts from every prefill worker (issue 46).

Admin keys only (a policy rule with admin = true; 401 without a key the policy knows, 403 for a key without admin),
as the status page. The tenant is named as the gateway derives its cache salt (edge.core.cache_salt): `key` (an API
key: its own salt, or its group's), or `tenant` (the tenant header's value, for a policy without keys). Each worker
drops that salt's prompt cache entries (RAM) and disk tier files between two prefills; the answer counts them per
worker. Prefixes cached under a salt a client sent (`cache_salt`, mixed into its key's) and the decode engine's prefix
blocks (named by hashes, freed as the pool needs them) are not reached.
"""

from __future__ import annotations

from aiohttp import web

from edge.api.fields import ApiError
from edge.core.run import bearer_key
from edge.state import GATEWAY, MODELS
from policies.quota import key_id


async def delete_tenant(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    policy = gateway.enforcer.policy
    check_admin(policy, request, "delete cached prompts")
    key, tenant = request.query.get("key"), request.query.get("tenant")
    if (key is None) == (tenant is None):
        raise ApiError(400, "name the tenant by exactly one of ?key=<api key> or ?tenant=<tenant header value>",
                       error_type="invalid_request_error", code="invalid_tenant")
    if key is not None and policy.keys and key not in policy.keys:
        raise ApiError(404, "no such API key in the policy in force", error_type="invalid_request_error",
                       code="unknown_key")
    if key is not None:
        salt = gateway.salter.salt(policy.prefix_cache_scope, key_id(key), None, "",
                                   policy.prefix_cache_groups.get(key))
    else:
        salt = gateway.salter.salt(policy.prefix_cache_scope, None, tenant)
    answers = {}
    for model, served in _loaded(request.app):  # every loaded model's workers (issue 45), by model/worker
        answers.update({f"{model}/{name}" if model else name: answer
                        for name, answer in (await served.pool.forget_salt(salt)).items()})
    workers = {name: None if a is None else {"entries": a.entries, "files": a.files} for name, a in answers.items()}
    return web.json_response({"deleted": {"entries": sum(w["entries"] for w in workers.values() if w),
                                          "files": sum(w["files"] for w in workers.values() if w)},
                              "workers": workers, "shared": salt == ""})


def _loaded(app: web.Application) -> list[tuple[str, object]]:
    """(model name or "" for the single model, its gateway) of every loaded model."""
    registry = app.get(MODELS)
    if registry is None or not registry.several:
        return [("", app[GATEWAY])]
    return [(name, registry.stack(name).gateway) for name in registry.names if registry.stack(name) is not None]


def check_admin(policy, request: web.Request, what: str) -> None:
    """Operator routes: 401 without a key the policy knows, 403 for a key without admin = true; open without keys."""
    if not policy.keys:
        return  # no keys: the server is open, as the status page is
    rule = policy.keys.get(bearer_key(request) or "")
    if rule is None:
        raise ApiError(401, f"an admin API key is needed to {what}: 'Authorization: Bearer <key>'",
                       error_type="authentication_error", code="invalid_api_key")
    if not rule.admin:
        raise ApiError(403, f"this API key may not {what} (its policy rule has no admin = true)",
                       error_type="permission_error", code="not_admin")
