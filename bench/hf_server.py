"""The transformers baseline: a plain OpenAI-style chat server around `model.generate`, one request at a time.

    python -m bench.hf_server --model PATH.gguf --port 8200

What a team would get by wrapping transformers directly: same weights as our decode engine (the
converted GGUF), greedy generate with a text streamer, requests served in arrival order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import torch
from aiohttp import web
from transformers import TextIteratorStreamer

from contracts.identity import read_gguf_identity
from decode_gpu.model.loader import load_decode_model, load_tokenizer
from decode_gpu.runner.device import resolve_device, resolve_dtype

MODEL = web.AppKey("model", object)
TOKENIZER = web.AppKey("tokenizer", object)
LOCK = web.AppKey("lock", asyncio.Lock)


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    model, tokenizer = request.app[MODEL], request.app[TOKENIZER]
    ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"].to(model.device)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    async with request.app[LOCK]:  # one generate at a time: the baseline has no batching
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        thread = threading.Thread(target=_generate, args=(model, ids, body.get("max_tokens", 64), streamer))
        thread.start()
        count, iterator = 0, iter(streamer)
        while (piece := await asyncio.to_thread(next, iterator, None)) is not None:
            if piece:
                count += 1
                chunk = {"object": "chat.completion.chunk", "created": int(time.time()),
                         "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        thread.join()
    usage = {"choices": [], "usage": {"completion_tokens": count}}
    await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return response


def _generate(model, ids, max_tokens: int, streamer) -> None:
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False, streamer=streamer)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "transformers", "object": "model"}]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    identity = read_gguf_identity(args.model)
    device = resolve_device(args.device)
    app = web.Application()
    app[MODEL] = load_decode_model(identity, device, resolve_dtype("auto", device))
    app[TOKENIZER] = load_tokenizer(identity)
    app[LOCK] = asyncio.Lock()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
