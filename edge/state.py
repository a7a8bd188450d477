"""aiohttp application keys: all gateway state lives under these, none in module globals."""

from aiohttp import web

from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.launch.launcher import Supervisor
from policies.reloader import PolicyReloader

CONFIG = web.AppKey("config", ServeConfig)
GATEWAY = web.AppKey("gateway", Gateway)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
RELOADER = web.AppKey("policy_reloader", PolicyReloader)
