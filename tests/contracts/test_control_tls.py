"""TLS on the TCP control links (contracts/control_tls.py, docs/security.md "Network"), on loopback with a test CA
made by trustme: a certificate of another CA is refused both ways, a plain peer is refused by a TLS listener, a
relay on the path reads no prompt and cannot alter a frame, a relay holding a certificate of the same CA cannot pass
the handshake, idle unauthenticated connections are closed and their number is bounded, and plain TCP off loopback
refuses to start."""

import asyncio
import dataclasses

import pytest
import trustme

from contracts import control_tls
from contracts.control_tls import MAX_PENDING, ControlTLS, ControlTLSError, PlaintextControlError
from contracts.framing import (
    PeerRefusedError,
    ProtocolError,
    accept_peer,
    connect_when_listening,
    open_connection,
    read_message,
    send_message,
    start_server,
)
from contracts.handoff import SamplingParams
from contracts.messages import Challenge, ChatMessage, Hello, PrefillFailed, PrefillJob
from contracts.options import KNOBS

SECRET = b"0123456789abcdef0123456789abcdef"
PROMPT = "the launch code is 4815162342, tell nobody"


def run(coro, timeout_s: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, ControlTLS]:
    """Control TLS settings by name: gateway, worker and mallory hold certificates of one CA; rogue of another."""
    folder = tmp_path_factory.mktemp("control-pki")
    settings = {}
    for ca_name, names in (("ca", ("gateway", "worker", "mallory")), ("rogue-ca", ("rogue",))):
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(folder / f"{ca_name}.pem"))
        for name in names:
            leaf = ca.issue_cert("localhost", "127.0.0.1", common_name=name)
            leaf.cert_chain_pems[0].write_to_path(str(folder / f"{name}.pem"))
            leaf.private_key_pem.write_to_path(str(folder / f"{name}.key"))
            settings[name] = ControlTLS(str(folder / f"{name}.pem"), str(folder / f"{name}.key"),
                                        str(folder / f"{ca_name}.pem"), handshake_timeout_s=2.0).check()
    rogue = settings["rogue"]  # its certificate from the other CA, but trusting the cluster's: only its peer refuses
    settings["rogue-trusting"] = dataclasses.replace(rogue, ca=settings["worker"].ca).check()
    settings["plain"] = ControlTLS()
    return settings


def job(prompt: str = PROMPT) -> PrefillJob:
    return PrefillJob("r1", SamplingParams(), messages=(ChatMessage("user", prompt),))


class Listener:
    """A TCP control listener that passes the handshake, then hands each frame it reads to `frames`."""

    def __init__(self, tls: ControlTLS) -> None:
        self.tls = tls
        self.hellos: list[Hello] = []
        self.frames: list = []
        self.errors: list[Exception] = []
        self.ended = asyncio.Event()

    async def __aenter__(self):
        self.server = await start_server(self._handle, "tcp://127.0.0.1:0", self.tls)
        self.address = f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _handle(self, reader, writer):
        hello = await accept_peer(reader, writer, SECRET)
        if hello is None:
            return
        self.hellos.append(hello)
        try:
            while (message := await read_message(reader)) is not None:
                self.frames.append(message)
        except ProtocolError as err:
            self.errors.append(err)
        finally:
            writer.close()
            self.ended.set()


class Relay:
    """An on-path TCP relay: forwards bytes both ways and records them; with `tamper` set it flips one bit of the
    next chunk it forwards towards the listener (in the second prompt when it can read it), with `tamper_back` of
    the next one towards the connecting peer."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen = bytearray()
        self.tamper = self.tamper_back = False
        self.tampered = asyncio.Event()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.address = f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _handle(self, client_reader, client_writer):
        host, _, port = self.target.removeprefix("tcp://").rpartition(":")
        server_reader, server_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(self._pipe(client_reader, server_writer, towards_listener=True),
                             self._pipe(server_reader, client_writer, towards_listener=False))

    async def _pipe(self, reader, writer, towards_listener: bool) -> None:
        while chunk := await reader.read(65536):
            self.seen += chunk
            if towards_listener and self.tamper or not towards_listener and self.tamper_back:
                self.tamper = self.tamper_back = False
                at = chunk.find(b"second prompt")  # in the prompt where the relay can read it, else near the end
                at = at if at >= 0 else len(chunk) - 8
                chunk = chunk[:at] + bytes([chunk[at] ^ 0x01]) + chunk[at + 1:]
                self.tampered.set()
            writer.write(chunk)
            await writer.drain()
        writer.close()


def test_a_tls_link_carries_frames_between_holders_of_the_ca(pki):
    async def scenario():
        async with Listener(pki["worker"]) as peer:
            reader, writer = await connect_when_listening(peer.address, "gateway", "gw", SECRET, 5, pki["gateway"])
            assert writer.get_extra_info("ssl_object").version() == "TLSv1.3"
            await send_message(writer, job())
            writer.close()
            await peer.ended.wait()
            return peer.hellos, peer.frames
    hellos, frames = run(scenario())
    assert [h.name for h in hellos] == ["gw"] and frames == [job()]


@pytest.mark.parametrize("side", ["connecting", "listening"])
def test_a_certificate_of_another_ca_is_refused(pki, side):
    """Either end holding a certificate the other's CA did not sign: refused at the TLS handshake, naming the
    CA; the listener's handler never sees the peer. The rogue trusts the cluster's CA, so the refusal is the
    other side's."""
    listener, connecting = ("worker", "rogue-trusting") if side == "connecting" else ("rogue", "gateway")

    async def scenario():
        async with Listener(pki[listener]) as peer:
            with pytest.raises(PeerRefusedError, match="control_tls_ca") as refused:
                await connect_when_listening(peer.address, "gateway", "gw", SECRET, 5, pki[connecting])
            return peer.hellos, str(refused.value)
    hellos, reason = run(scenario())
    assert hellos == []
    if side == "listening":  # else TLS 1.3 tells the peer as it closes, or only closes: either way refused
        assert "CERTIFICATE_VERIFY_FAILED" in reason, reason


def test_a_plaintext_peer_is_refused_by_a_tls_listener(pki):
    async def scenario():  # a plain peer waits for a challenge, the listener for TLS: closed at the time limit
        async with Listener(dataclasses.replace(pki["worker"], handshake_timeout_s=0.5)) as peer:
            with pytest.raises(PeerRefusedError, match="closed the connection before its challenge.*control_tls"):
                await connect_when_listening(peer.address, "gateway", "gw", SECRET, 5, pki["plain"])
            # a raw peer that writes a frame straight away gets nothing read as a frame
            host, port = peer.server.sockets[0].getsockname()[:2]
            reader, writer = await asyncio.open_connection(host, port)
            await send_message(writer, job())
            assert await reader.read() == b""
            return peer.hellos, peer.frames
    assert run(scenario()) == ([], [])


def test_a_tls_client_is_refused_by_a_plaintext_listener(pki):
    async def scenario():
        async with Listener(pki["plain"]) as peer:
            with pytest.raises(PeerRefusedError, match="TLS handshake"):
                await connect_when_listening(peer.address, "gateway", "gw", SECRET, 5, pki["gateway"])
            return peer.hellos
    assert run(scenario()) == []


@pytest.mark.parametrize("tls", ["plain", "tls"])
def test_a_relay_on_the_path_reads_and_alters_a_plain_link_but_not_a_tls_one(pki, tls):
    """Through a relay: in plain TCP the prompt is on the wire and a flipped bit arrives as a different frame;
    inside TLS neither: the bytes hold no prompt and the altered record breaks the connection, no frame delivered."""
    listening, connecting = (pki["plain"], pki["plain"]) if tls == "plain" else (pki["worker"], pki["gateway"])

    async def scenario():
        async with Listener(listening) as peer, Relay(peer.address) as relay:
            reader, writer = await connect_when_listening(relay.address, "gateway", "gw", SECRET, 5, connecting)
            await send_message(writer, job())
            while len(peer.frames) < 1:
                await asyncio.sleep(0.01)
            relay.tamper = True
            await send_message(writer, job("the second prompt travels after the first one"))
            await relay.tampered.wait()
            if tls == "plain":
                while len(peer.frames) < 2:
                    await asyncio.sleep(0.01)
            else:
                await asyncio.wait_for(peer.ended.wait(), 5)
                assert await reader.read() == b""  # the listener hung up
            writer.close()
            return bytes(relay.seen), peer.frames, peer.errors
    seen, frames, errors = run(scenario())
    assert frames[0] == job()
    if tls == "plain":  # the test's relay does what the issue's did
        assert PROMPT.encode() in seen
        assert len(frames) == 2 and frames[1] == job("the recond prompt travels after the first one")
    else:
        assert PROMPT.encode() not in seen and b"launch code" not in seen and b"PrefillJob" not in seen
        assert len(frames) == 1 and len(errors) == 1 and "TLS" in str(errors[0])


@pytest.mark.usefixtures("restore_process_tls")
def test_the_gateway_pool_through_a_tampering_relay_gets_no_forged_answer(pki):
    """The attack as it was made: a relay between the gateway and a worker alters what the worker sends while a
    request is in prefill. With TLS the gateway's pool drops the connection (a bad frame) and fails the request as
    a lost worker, never with a frame the relay made, and connects again."""
    from contracts.messages import Heartbeat, WorkerStatus
    from edge.core.lifecycle import InFlight, InFlightRegistry
    from edge.core.prefill_pool import PrefillPool

    async def worker(reader, writer):
        if await accept_peer(reader, writer, SECRET) is None:
            return
        await send_message(writer, WorkerStatus("w0", "fp", 4096, "q8_0", 49152))
        try:
            while True:
                await send_message(writer, Heartbeat(None))
                await asyncio.sleep(0.05)
        except ConnectionError:
            pass

    async def scenario():
        server = await start_server(worker, "tcp://127.0.0.1:0", pki["worker"])
        port = server.sockets[0].getsockname()[1]
        async with Relay(f"tcp://127.0.0.1:{port}") as relay:
            registry = InFlightRegistry()
            pool = PrefillPool({"w0": relay.address}, registry, queue_limit=8, secret=SECRET, heartbeat_timeout_s=5)
            control_tls.configure(pki["gateway"])
            task = asyncio.create_task(pool.run())
            while pool.num_ready != 1:
                await asyncio.sleep(0.01)
            request = InFlight("r1", 0)
            registry.add(request)
            pool.submit(job())
            while pool.workers["w0"].current_id != "r1":
                await asyncio.sleep(0.01)
            relay.tamper_back = True
            failure = await asyncio.wait_for(request.events.get(), 5)
            while pool.num_ready != 1:  # connected again, through the same relay
                await asyncio.sleep(0.01)
            task.cancel()
            server.close()
            return failure, pool.workers["w0"].last_error, bytes(relay.seen)
    failure, error, seen = run(scenario())
    assert isinstance(failure, PrefillFailed) and failure.kind == "worker_died", failure
    assert PROMPT.encode() not in seen


class TerminatingRelay:
    """A relay that holds a certificate of the cluster's CA but not the secret: it ends each side's TLS itself
    and forwards the frames between the two sessions (reading them)."""

    def __init__(self, target: str, tls: ControlTLS) -> None:
        self.target, self.tls = target, tls

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls.server_context)
        self.address = f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _handle(self, client_reader, client_writer):
        server_reader, server_writer = await open_connection(self.target, self.tls)
        await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer))

    async def _pipe(self, reader, writer) -> None:
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        writer.close()


def test_a_relay_with_a_certificate_of_the_same_ca_cannot_pass_the_handshake(pki):
    """The handshake's proofs cover both certificates each side saw: relayed between two TLS sessions, they do
    not match, so holding a CA certificate without the secret gets a relay nowhere."""
    async def scenario():
        async with Listener(pki["worker"]) as peer, TerminatingRelay(peer.address, pki["mallory"]) as relay:
            with pytest.raises(PeerRefusedError, match="relay stands between them"):
                await connect_when_listening(relay.address, "gateway", "gw", SECRET, 5, pki["gateway"])
            return peer.hellos
    assert run(scenario()) == []


@pytest.mark.parametrize("tls", ["plain", "tls-idle-before-tls", "tls-idle-after-tls"])
def test_an_idle_unauthenticated_connection_is_closed_at_the_handshake_limit(pki, tls):
    settings = dataclasses.replace(pki["plain" if tls == "plain" else "worker"], handshake_timeout_s=0.5)

    async def scenario():
        async with Listener(settings) as peer:
            loop = asyncio.get_running_loop()
            started = loop.time()
            if tls == "tls-idle-after-tls":  # passes TLS, then says nothing
                reader, writer = await open_connection(peer.address, pki["gateway"])
            else:  # says nothing at all
                host, port = peer.server.sockets[0].getsockname()[:2]
                reader, writer = await asyncio.open_connection(host, port)
            try:
                while await reader.read(65536):
                    pass
            except (ConnectionError, OSError):
                pass
            return loop.time() - started
    # closed at the 0.5 s set, not at the default limit: below that with room for a busy machine
    assert 0.3 < run(scenario()) < KNOBS["control_handshake_timeout_s"].default - 1.0


def test_pending_unauthenticated_connections_are_bounded(pki):
    """MAX_PENDING silent peers hold every pending slot: the next connection is closed at once, and a real peer
    gets in once they are gone."""
    settings = dataclasses.replace(pki["plain"], handshake_timeout_s=30.0)

    async def scenario():
        async with Listener(settings) as peer:
            host, port = peer.server.sockets[0].getsockname()[:2]
            idle = []
            for _ in range(MAX_PENDING):
                reader, writer = await asyncio.open_connection(host, port)
                assert isinstance(await read_message(reader), Challenge)  # admitted: challenged
                idle.append(writer)
            reader, writer = await asyncio.open_connection(host, port)
            # closed without a challenge, at once: 10 s for a busy machine, far below the 30 s a pending slot waits
            assert await asyncio.wait_for(reader.read(), 10) == b""
            for writer in idle:
                writer.close()
            _, writer = await connect_when_listening(peer.address, "gateway", "gw", SECRET, 5, settings)
            writer.close()
            deadline = asyncio.get_running_loop().time() + 30.0  # a busy machine may run the listener late
            while not peer.hellos and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            return peer.hellos
    assert [h.name for h in run(scenario(), 60.0)] == ["gw"]


def test_plain_tcp_off_loopback_refuses_to_start_unless_allowed(pki):
    async def scenario():
        with pytest.raises(PlaintextControlError, match="allow_plaintext_control"):
            await start_server(lambda r, w: None, "tcp://0.0.0.0:0", pki["plain"])
        with pytest.raises(PlaintextControlError, match="allow_plaintext_control"):
            await open_connection("tcp://192.0.2.7:9100", pki["plain"])  # refused before any packet
        allowed = await start_server(lambda r, w: None, "tcp://0.0.0.0:0",
                                     dataclasses.replace(pki["plain"], allow_plaintext=True))
        allowed.close()
        with_tls = await start_server(lambda r, w: None, "tcp://0.0.0.0:0", pki["worker"])
        with_tls.close()
        loopback = await start_server(lambda r, w: None, "tcp://127.0.0.1:0", pki["plain"])
        loopback.close()
    run(scenario())


def test_a_half_given_or_broken_tls_setting_is_refused_naming_it(pki, tmp_path):
    worker = pki["worker"]
    with pytest.raises(ControlTLSError, match="control_tls_ca not set"):
        ControlTLS(worker.certfile, worker.keyfile).check()
    with pytest.raises(ControlTLSError, match="control_tls_certfile .* no PEM certificate"):
        ControlTLS(worker.keyfile, worker.certfile, worker.ca).check()
    with pytest.raises(ControlTLSError, match="the key is not the certificate's"):
        ControlTLS(worker.certfile, pki["gateway"].keyfile, worker.ca).check()
    with pytest.raises(ControlTLSError, match=f"control_tls_ca {tmp_path}/missing.pem: cannot read"):
        ControlTLS(worker.certfile, worker.keyfile, str(tmp_path / "missing.pem")).check()


def test_the_process_settings_reach_every_link(pki):
    """configure() sets what start_server and connect_when_listening use when a caller passes nothing: the
    processes set it once from their config (ControlTLS.of)."""
    before = control_tls.current()
    try:
        control_tls.configure(pki["worker"])

        async def scenario():
            async with Listener(None) as peer:
                _, writer = await connect_when_listening(peer.address, "gateway", "gw", SECRET, 5)
                assert writer.get_extra_info("ssl_object") is not None
                await send_message(writer, PrefillFailed("r1", "bad_request", "forged?"))
                writer.close()
                await peer.ended.wait()
                return peer.frames
        assert run(scenario()) == [PrefillFailed("r1", "bad_request", "forged?")]
    finally:
        control_tls.configure(before)


def test_is_loopback():
    assert all(control_tls.is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"))
    assert not any(control_tls.is_loopback(h) for h in ("0.0.0.0", "10.0.0.5", "::", "engine.internal"))


def gateway_config(tmp_path, **values):
    from edge.config import ServeConfig
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    return ServeConfig(launch=False, control_secret_file=str(secret), run_dir=str(tmp_path / "run"), **values)


@pytest.fixture
def restore_process_tls():
    before = control_tls.current()
    yield
    control_tls.configure(before)


@pytest.mark.usefixtures("restore_process_tls")
def test_edge_serve_refuses_plain_control_links_off_loopback_unless_allowed(pki, tmp_path):
    from edge.app import make_app
    remote = {"engine_address": "tcp://192.0.2.7:9100", "worker_addresses": ("tcp://192.0.2.8:9101",)}
    with pytest.raises(ValueError, match="tcp://192.0.2.7:9100: control frames .* allow_plaintext_control = true"):
        make_app(gateway_config(tmp_path, **remote))
    with pytest.raises(ValueError, match="^ray: .*allow_plaintext_control = true"):  # before Ray is even joined
        make_app(gateway_config(tmp_path, ray="auto"))
    make_app(gateway_config(tmp_path, **remote, allow_plaintext_control=True))
    worker = pki["worker"]
    make_app(gateway_config(tmp_path, **remote, control_tls_certfile=worker.certfile,
                            control_tls_keyfile=worker.keyfile, control_tls_ca=worker.ca))
    assert control_tls.current().on  # what the gateway's links use from now on
    with pytest.raises(ValueError, match="control_tls_keyfile not set"):
        make_app(gateway_config(tmp_path, **remote, control_tls_certfile=worker.certfile, control_tls_ca=worker.ca))


@pytest.mark.usefixtures("restore_process_tls")
def test_a_child_takes_its_control_tls_from_its_config_and_refuses_plain_tcp_off_loopback(pki):
    from contracts.process_config import WorkerProcessConfig, encode_config, parse_config
    worker = pki["worker"]
    config = WorkerProcessConfig(model="m.gguf", listen="tcp://0.0.0.0:9101", engine="tcp://192.0.2.7:9100")
    with pytest.raises(SystemExit, match="WorkerProcessConfig: tcp://0.0.0.0:9101: .*allow_plaintext_control"):
        parse_config(WorkerProcessConfig, ["--config-json", encode_config(config)], "")
    tls_config = dataclasses.replace(config, control_tls_certfile=worker.certfile, control_tls_keyfile=worker.keyfile,
                                     control_tls_ca=worker.ca)
    assert parse_config(WorkerProcessConfig, ["--config-json", encode_config(tls_config)], "") == tls_config
    assert control_tls.current() == ControlTLS.of(tls_config) and control_tls.current().on
    by_hand = parse_config(WorkerProcessConfig, ["--model", "m.gguf", "--listen", "tcp://0.0.0.0:9101",
                                                 "--allow-plaintext-control"], "")
    assert by_hand.allow_plaintext_control and not control_tls.current().on
    with pytest.raises(SystemExit, match="control_tls_certfile .*cannot read"):
        parse_config(WorkerProcessConfig, ["--model", "m.gguf", "--listen", "unix:/w.sock",
                                           "--control-tls-certfile", "/nonexistent.pem",
                                           "--control-tls-keyfile", worker.keyfile, "--control-tls-ca", worker.ca], "")
