"""llama.cpp's own server tests (their OpenAI-compatible files) run against our server, as an outside check.

The tests ship in the pinned llama-cpp-python source archive (vendor/llama.cpp/tools/server/tests/unit/). They
start llama-server themselves through their utils.py; its DEBUG_EXTERNAL switch makes them use a server already
listening on PORT instead. So this check starts `edge serve` on the embedded model, puts a small proxy in front of
it and runs their files with pytest against the proxy. The proxy does only what llama-server does and OpenAI does
not: it serves the OpenAI routes without the /v1 prefix too (/chat/completions, /completions, /responses), and it
puts our model's name in a body's "model" (llama-server serves one model and ignores the field; we refuse a name we
do not serve). Nothing else is changed. What they expect and we do not share is listed, with the reason, in
docs/api.md ("Differences from OpenAI").

    .venv/bin/python -m checks.llama_server_tests [--sdist PATH] [--files test_chat_completion.py ...]
        [--report checks/llama_server_tests.json]

Their tests marked slow (real models from Hugging Face) are left out, as their tests.sh does by default. Prints
passed/failed/skipped per file and writes every test's outcome (with the first line of its failure) to the
report. No model is downloaded: their model presets are never loaded (the external server answers instead), and
their `wget` is replaced by a module that refuses to download.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
from aiohttp import ClientSession, ClientTimeout, web

VERSION = "0.3.36"  # the llama-cpp-python pin in pyproject.toml
FILES = ("test_chat_completion.py", "test_completion.py", "test_tool_call.py", "test_compat_oai_responses.py")
TESTS_DIR = "vendor/llama.cpp/tools/server/tests"
UNPREFIXED = ("/chat/completions", "/completions", "/responses", "/embeddings", "/models")
SERVE_CONFIG = """
kv_cache_tokens = 8192
max_model_len = 2048
"""
NO_DOWNLOAD = '''def download(url, out=None, bar=None):
    raise RuntimeError(f"this check downloads nothing (asked for {url})")
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sdist", help=f"llama_cpp_python-{VERSION}.tar.gz (default: found, else pip download)")
    parser.add_argument("--files", nargs="+", default=list(FILES), help="their unit test files to run")
    parser.add_argument("--report", default="checks/llama_server_tests.json", help="where the outcomes go")
    parser.add_argument("-k", default="", help="pytest -k expression passed on to their tests")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llama-server-tests-") as tmp:
        work = Path(tmp)
        tests = extract_tests(find_sdist(args.sdist, work), work)
        results = asyncio.run(run(tests, work, args.files, args.k))
    Path(args.report).write_text(json.dumps(results, indent=1) + "\n")
    for name, outcome in results["files"].items():
        print(f"{name}: {outcome['passed']} passed, {outcome['failed']} failed, {outcome['skipped']} skipped")
    print(f"in all: {results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped "
          f"({results['seconds']:.0f} s); outcomes in {args.report}")
    return 0


def find_sdist(given: str | None, work: Path) -> Path:
    if given:
        return Path(given)
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    for pattern in (f"/tmp/llsrc/{name}", str(Path.home() / ".cache" / "pip" / "**" / name)):
        if found := glob.glob(pattern, recursive=True):
            return Path(found[0])
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(work)], check=True)
    return work / name


def extract_tests(sdist: Path, work: Path) -> Path:
    prefix = f"llama_cpp_python-{VERSION}/{TESTS_DIR}/"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        archive.extractall(work, members=members, filter="data")
    return work / prefix


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(tests: Path, work: Path, files: list[str], keyword: str) -> dict:
    (work / "shim").mkdir()
    (work / "shim" / "wget.py").write_text(NO_DOWNLOAD)
    config = work / "serve.toml"
    config.write_text(SERVE_CONFIG)
    port, proxy_port = free_port(), free_port()
    log = open(work / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "edge.cli", "serve", "--config", str(config), "--port",
                               str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        model = await wait_ready(f"http://127.0.0.1:{port}", server, work / "serve.log")
        runner = await start_proxy(f"http://127.0.0.1:{port}", model, proxy_port)
        try:
            started = time.monotonic()
            junit = work / "junit.xml"
            env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(proxy_port),
                   "PYTHONPATH": os.pathsep.join([str(work / "shim"), str(tests)])}
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m",
                       "not slow",  # as their tests.sh runs them by default (slow ones download real models)
                       f"--junitxml={junit}", *(["-k", keyword] if keyword else []),
                       *[f"unit/{name}" for name in files if (tests / "unit" / name).exists()]]
            process = await asyncio.create_subprocess_exec(*command, cwd=tests, env=env,
                                                           stdout=asyncio.subprocess.DEVNULL)
            await process.wait()
            return {**outcomes(junit), "seconds": time.monotonic() - started, "model": model,
                    "missing_files": [name for name in files if not (tests / "unit" / name).exists()]}
        finally:
            await runner.cleanup()
    finally:
        server.terminate()
        server.wait(60)
        log.close()


async def wait_ready(base: str, server: subprocess.Popen, log: Path, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"edge serve exited:\n{log.read_text()[-3000:]}")
            try:
                if (await client.get(base + "/health", timeout=2)).status_code == 200:
                    return (await client.get(base + "/v1/models", timeout=5)).json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"edge serve not ready in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


async def start_proxy(base: str, model: str, port: int) -> web.AppRunner:
    """The two adaptations to llama-server's habits named in the module's doc, and nothing else."""
    session = ClientSession(timeout=ClientTimeout(total=600))

    async def forward(request: web.Request) -> web.StreamResponse:
        path = request.path
        if path in UNPREFIXED:
            path = "/v1" + path
        raw = await request.read()
        if raw and request.method == "POST":
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if isinstance(body, dict):
                raw = json.dumps({**body, "model": model}).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with session.request(request.method, base + path, data=raw or None, headers=headers,
                                   params=request.query) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")})
            await response.prepare(request)
            async for piece in upstream.content.iter_any():
                await response.write(piece)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_cleanup.append(lambda _: session.close())
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def outcomes(junit: Path) -> dict:
    files: dict[str, dict] = {}
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("classname", "").split(".")[-1] + ".py"
        entry = files.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0, "tests": {}})
        problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if problem is None else "skipped" if problem.tag == "skipped" else "failed"
        entry[outcome] += 1
        totals[outcome] += 1
        why = (problem.get("message") or "").strip().split("\n")[0][:300] if problem is not None else ""
        entry["tests"][case.get("name")] = f"{outcome}: {why}" if why else outcome
    return {**totals, "files": files}


if __name__ == "__main__":
    sys.exit(main())
