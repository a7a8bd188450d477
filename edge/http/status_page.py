"""The operator's status page (/, /status), its JSON polls (/status.json), and its sign-in and sign-out: an admin
key opens a session whose cookie lets the page's polls in (edge.observe.status_board holds the sessions)."""

from __future__ import annotations

from aiohttp import BasicAuth, web

from edge.api.fields import ApiError
from edge.observe.status_board import LOGIN_PAGE, SESSION_COOKIE, SESSIONS, STATUS, page
from edge.state import GATEWAY

NO_STORE = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}  # the status page and its session


async def status_page(request: web.Request) -> web.Response:
    """The page, for an admin: a key sent with the load (basic auth, a bearer header) opens a session whose cookie
    lets the page's polls in; without one, a browser asks for the key (basic auth) or shows the sign-in form."""
    try:
        key, token = _admin_key(request, challenge=True)
    except ApiError as err:
        if err.status != 401 or "text/html" not in request.headers.get("Accept", ""):
            raise
        return web.Response(status=401, text=LOGIN_PAGE, content_type="text/html",
                            headers={**NO_STORE, **(err.headers or {})})  # a browser: its dialog, else the form
    response = web.Response(text=page(), content_type="text/html", headers=NO_STORE)
    if key is not None and token is None:
        sessions = request.app[SESSIONS]
        sessions.set_cookie(response, sessions.start(key), request.secure)
    return response


async def status_login(request: web.Request) -> web.Response:
    """POST /status/login (form field `key`, or a bearer header): a session cookie for an admin key, then the page."""
    form = await request.post()
    key = form.get("key") if isinstance(form.get("key"), str) else _sent_key(request)
    _check_admin(request, key, challenge=False)
    response = web.Response(status=303, headers={**NO_STORE, "Location": "/status"})
    sessions = request.app[SESSIONS]
    sessions.set_cookie(response, sessions.start(key or ""), request.secure)
    return response


async def status_logout(request: web.Request) -> web.Response:
    request.app[SESSIONS].end(request.cookies.get(SESSION_COOKIE))
    response = web.Response(status=303, headers={**NO_STORE, "Location": "/status"})
    response.del_cookie(SESSION_COOKIE, path="/")
    return response


async def status_json(request: web.Request) -> web.Response:
    _admin_key(request, challenge=False)
    board = request.app.get(STATUS)
    if board is None:
        raise ApiError(503, "the status board is not running", error_type="server_error", code="unavailable")
    try:
        since = float(request.query.get("since", "0"))
    except ValueError:
        raise ApiError(400, "since must be a number (epoch seconds)", "since", "invalid_value") from None
    return web.json_response(board.snapshot(since), headers=NO_STORE)


def _admin_key(request: web.Request, challenge: bool) -> tuple[str | None, str | None]:
    """(the admin key, the session token it came by, or None): the key of the request's live status session, else
    one sent as a bearer token or as the password of HTTP basic auth (what a browser can send on a page load); its
    rule must have admin = true in the policy in force. (None, None) when the policy has no keys: then the page
    is open, as the API is. challenge: make a browser ask for the key (not on the JSON polls, where a dialog
    would pop up on every refused poll)."""
    if not request.app[GATEWAY].enforcer.policy.keys:
        return None, None
    token = request.cookies.get(SESSION_COOKIE)
    key = request.app[SESSIONS].key(token)
    if key is None:
        key, token = _sent_key(request), None
    _check_admin(request, key, challenge)
    return key, token


def _check_admin(request: web.Request, key: str | None, challenge: bool) -> None:
    rule = request.app[GATEWAY].enforcer.policy.keys.get(key or "")
    if rule is None:
        headers = {"WWW-Authenticate": 'Basic realm="edge status", charset="UTF-8"'} if challenge else {}
        raise ApiError(401, "the status page needs an admin API key: 'Authorization: Bearer <key>', or basic auth "
                            "with the key as the password", error_type="authentication_error",
                       code="invalid_api_key", headers=headers)
    if not rule.admin:
        raise ApiError(403, "this API key may not see the status page (its policy rule has no admin = true)",
                       error_type="permission_error", code="not_admin")


def _sent_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    try:
        return BasicAuth.decode(header).password if header else None
    except ValueError:  # not basic auth, or not base64
        return None
