"""The other APIs clients speak (OpenAI Responses, Anthropic Messages), as translations onto the chat completions
path: a request body becomes the same GenerateRequest a chat request does, and the same Completion's answer and
stream chunks become that API's body and events. The gateway's path (key, filters, quotas, priority, tiers, audit,
traces, metrics) is the one every route takes (edge/routes.py)."""
