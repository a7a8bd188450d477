"""aiohttp application keys: all gateway state lives under these, none in module globals."""

from aiohttp import web

from edge.api.response_store import ResponseStore
from edge.api.structured import GrammarChecks
from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.http.tokenizers import Tokenizers
from edge.launch.launcher import Supervisor
from edge.models.registry import ModelRegistry
from policies.reloader import PolicyReloader

CONFIG = web.AppKey("config", ServeConfig)
GATEWAY = web.AppKey("gateway", Gateway)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
RELOADER = web.AppKey("policy_reloader", PolicyReloader)
GRAMMAR_CHECKS = web.AppKey("grammar_checks", GrammarChecks)  # the gateway's structured-output compile processes
TOKENIZERS = web.AppKey("tokenizers", Tokenizers)  # one vocabulary per GGUF for /tokenize and count_tokens
RESPONSES = web.AppKey("responses", ResponseStore)  # stored Responses conversations, per API key
MODELS = web.AppKey("models", ModelRegistry)  # the configured models, their states and stacks (edge.models.registry)
