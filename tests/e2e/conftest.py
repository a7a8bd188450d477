"""The end-to-end modules' shared prologue: one `edge serve` per module, started from the module's CONFIG and POLICY
(its module attributes) with an audit log beside them, and the clients and readers bound to it (the openai client
with the module's KEY, the audit log's lines). A module that needs another server defines its own `server`
fixture (server_process.served), which takes precedence over this one."""

import json

import openai
import pytest

from server_process import ServerProcess


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """`edge serve` with the module's CONFIG and POLICY (None: the default policy), started once for the module's
    tests and stopped after the last; its audit log's path is `server.audit`."""
    module = request.module
    workdir = tmp_path_factory.mktemp("serve")
    audit = workdir / "audit.jsonl"
    config = f'audit_log = "{audit}"\n' + module.CONFIG  # first: the module's CONFIG may end inside a [table]
    with ServerProcess(config, workdir, getattr(module, "POLICY", None)).start() as process:
        process.audit = audit
        yield process


@pytest.fixture(scope="module")
def oai(server, request):
    """The official openai client against the server, with the module's KEY."""
    return openai.OpenAI(base_url=server.base + "/v1", api_key=request.module.KEY, max_retries=0, timeout=120)


@pytest.fixture
def audit_lines(server):
    """audit_lines(): the audit log's records so far, oldest first."""
    def read() -> list[dict]:
        return [json.loads(line) for line in server.audit.read_text().splitlines()]
    return read
