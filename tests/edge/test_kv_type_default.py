"""kv_type = "auto" (the default): f16 for workers whose handoff stays on this host, q8_0 across hosts; an
explicit type is passed through as given; a launched worker gets the resolved type in its config."""

import asyncio

import pytest
from aiohttp import web

from contracts.process_config import CONFIG_FLAG, EngineProcessConfig, WorkerProcessConfig, decode_config
from edge.api.structured import GrammarChecks
from edge.app import _processes
from edge.config import ServeConfig, is_local_address, load_config, worker_kv_type
from edge.state import CONFIG, GRAMMAR_CHECKS, SUPERVISOR


@pytest.mark.parametrize("address,local", [
    ("unix:/run/edge/engine.sock", True), ("tcp://127.0.0.1:9100", True), ("tcp://127.8.0.2:9100", True),
    ("tcp://localhost:9100", True), ("tcp://[::1]:9100", True),
    ("tcp://10.0.0.5:9100", False), ("tcp://gpu-box:9100", False), ("tcp://[fe80::1]:9100", False),
])
def test_local_addresses_are_unix_sockets_and_loopback(address, local):
    assert is_local_address(address) is local


def test_auto_is_the_default_and_resolves_per_topology():
    config = ServeConfig()
    assert config.kv_type == "auto"
    assert worker_kv_type(config, "unix:/tmp/edge-x/engine.sock") == "f16"
    assert worker_kv_type(config, "tcp://127.0.0.1:9100") == "f16"
    assert worker_kv_type(config, "tcp://10.0.0.5:9100") == "q8_0"


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_an_explicit_kv_type_is_kept_on_every_topology(kv_type):
    config = ServeConfig(kv_type=kv_type)
    assert {worker_kv_type(config, a) for a in ("unix:/e.sock", "tcp://10.0.0.5:9100")} == {kv_type}


class RecordingChecks(GrammarChecks):
    """The app's compile processes, warmed for the model at launch (here only recorded)."""

    def __init__(self) -> None:
        super().__init__()
        self.warmed: list[str | None] = []

    def warm(self, model_path: str | None) -> None:
        self.warmed.append(model_path)


class RecordingSupervisor:
    def __init__(self) -> None:
        self.added: dict[str, list[str]] = {}

    def add(self, name: str, module: str, args: list[str]) -> None:
        self.added[name] = args

    async def watch(self) -> None:
        await asyncio.Event().wait()

    async def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("kv_type,engine_address,expected", [
    ("auto", "unix:/tmp/edge-t/engine.sock", "f16"),
    ("auto", "tcp://10.0.0.5:9100", "q8_0"),
    ("q8_0", "unix:/tmp/edge-t/engine.sock", "q8_0"),
    ("q4_0", "unix:/tmp/edge-t/engine.sock", "q4_0"),
])
def test_launched_workers_get_the_resolved_kv_type(kv_type, engine_address, expected):
    async def launch() -> dict[str, list[str]]:
        app = web.Application()
        app[CONFIG], app[SUPERVISOR] = ServeConfig(kv_type=kv_type), RecordingSupervisor()
        app[GRAMMAR_CHECKS] = checks = RecordingChecks()
        context = _processes("model.gguf", engine_address, {"prefill-0": "unix:/a", "prefill-1": "unix:/b"},
                             "/tmp/edge-t")(app)
        await anext(context)
        await context.aclose()
        assert checks.warmed == ["model.gguf"]  # the app's own checks load the model's vocabulary meanwhile
        return app[SUPERVISOR].added

    added = asyncio.run(launch())
    configs = {name: decode_config(EngineProcessConfig if name == "decode_engine" else WorkerProcessConfig,
                                   args[args.index(CONFIG_FLAG) + 1]) for name, args in added.items()}
    assert {configs[name].kv_type for name in ("prefill-0", "prefill-1")} == {expected}
    assert not hasattr(configs["decode_engine"], "kv_type")  # the engine reads the KV type from each handoff
    # the engine and the workers launched here share the cores through one file in the run directory
    assert {config.cpu_share_file for config in configs.values()} == {"/tmp/edge-t/cpu-share"}


def test_a_config_file_may_say_auto_or_an_explicit_type_and_nothing_else(tmp_path):
    path = tmp_path / "serve.toml"
    for value in ("auto", "f16", "q8_0", "q4_0"):
        path.write_text(f'kv_type = "{value}"\n')
        assert load_config(str(path), {}).kv_type == value
    assert load_config(str(path), {"kv_type": "f16"}).kv_type == "f16"  # a flag wins over the file
    path.write_text('kv_type = "q2_k"\n')
    with pytest.raises(Exception, match="expected one of \\['auto', 'f16', 'q8_0', 'q4_0'\\]"):
        load_config(str(path), {})
