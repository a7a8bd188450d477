"""The engine process: the server entry point, the engine thread and its asyncio side, the gateway links."""
