"""The served GGUF as the routes need it: its path (whose vocabulary the gateway tokenizes and compiles constraints
over) and its chat template's tool-call and reasoning format."""

from __future__ import annotations

from edge.chat.tool_formats import ChatFormat, chat_format_of
from edge.core.gateway import Gateway


def model_path(gateway: Gateway) -> str | None:
    """The GGUF the workers load; None when the gateway does not know it (a `launch = false` gateway without one)."""
    from prefill_cpu.embedded_model import embedded_model_path
    try:
        return gateway.config.model or embedded_model_path()
    except FileNotFoundError:
        return None


async def chat_format(gateway: Gateway) -> ChatFormat:
    """The model's chat template as far as tools and reasoning go (read from its GGUF once, edge.chat.tool_formats)."""
    config = gateway.config
    return await chat_format_of(model_path(gateway), config.tool_call_parser, config.reasoning_parser)
