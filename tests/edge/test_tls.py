"""HTTPS and mutual TLS (docs/tls.md): the real service over TLS with the official openai client; clients
that must be refused are; every TLS mistake (and a bad config) stops `edge serve` with one clear line before
anything starts. Certificates are made here with the openssl binary, as docs/tls.md tells operators to."""

import ssl
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from aiohttp import web

from edge import cli
from edge.config import ServeConfig
from edge.http.tls import server_context
from server_process import ServerProcess

SERVER_EXT = "subjectAltName = IP:127.0.0.1, DNS:localhost\nextendedKeyUsage = serverAuth\n"
CLIENT_EXT = "extendedKeyUsage = clientAuth\n"


def openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def make_ca(folder: Path, name: str) -> None:
    openssl(folder, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=edge-llm test {name}")


def make_signed(folder: Path, name: str, ca: str, extensions: str) -> None:
    openssl(folder, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (folder / f"{name}.ext").write_text(extensions)
    openssl(folder, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca signs server and client; rogue is another CA, which signed rogue-client; encrypted.key is
    server.key under a passphrase."""
    folder = tmp_path_factory.mktemp("pki")
    make_ca(folder, "ca")
    make_signed(folder, "server", "ca", SERVER_EXT)
    make_signed(folder, "client", "ca", CLIENT_EXT)
    make_ca(folder, "rogue")
    make_signed(folder, "rogue-client", "rogue", CLIENT_EXT)
    openssl(folder, "pkey", "-in", "server.key", "-aes256", "-passout", "pass:secret", "-out", "encrypted.key")
    return folder


def client_context(pki: Path, cert: str | None = None) -> ssl.SSLContext:
    """Trusts our CA; presents pki/<cert>.pem if given."""
    context = ssl.create_default_context(cafile=pki / "ca.pem")
    if cert:
        context.load_cert_chain(pki / f"{cert}.pem", pki / f"{cert}.key")
    return context


# ---- the real service over mutual TLS: one start for every test below ----

@pytest.fixture(scope="module")
def server(pki, tmp_path_factory):
    config = (f'ssl_certfile = "{pki / "server.pem"}"\nssl_keyfile = "{pki / "server.key"}"\n'
              f'ssl_ca_certs = "{pki / "ca.pem"}"\nkv_cache_tokens = 2048\n[limits]\nshutdown_grace_s = 1.0\n')
    server = ServerProcess(config, tmp_path_factory.mktemp("tls-serve"), tls=client_context(pki, "client")).start()
    yield server
    server.stop()


@pytest.mark.slow
def test_chat_over_mutual_tls_with_the_openai_client(server, pki):
    assert server.base.startswith("https://")
    with httpx.Client(verify=client_context(pki, "client")) as http:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", http_client=http, max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a color."}],
                                              max_tokens=4, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 4
    # the listening address in the log carries the scheme clients must use
    assert f"Running on https://127.0.0.1:{server.port}" in server.log_path.read_text()


@pytest.mark.slow
def test_plain_http_gets_no_answer(server):
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10)


@pytest.mark.slow
def test_a_client_that_does_not_trust_the_ca_fails(server):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.base + "/health", timeout=10)  # the system's CAs never signed our test CA


@pytest.mark.slow
@pytest.mark.parametrize("cert", [None, "rogue-client"])
def test_a_client_without_a_certificate_from_the_ca_is_refused(server, pki, cert):
    # asyncio drops a connection whose handshake failed without sending TLS's alert: the client sees it closed
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        httpx.get(server.base + "/health", timeout=10, verify=client_context(pki, cert))
    assert httpx.get(server.base + "/health", timeout=10, verify=client_context(pki, "client")).status_code == 200


# ---- `edge serve` wiring and refusals, without starting anything ----

@pytest.fixture
def run_app(monkeypatch) -> dict:
    """edge.cli.main with the app and aiohttp's runner replaced: what run_app would have been given."""
    given = {}
    monkeypatch.setattr("edge.app.make_app", lambda config: web.Application())
    monkeypatch.setattr(cli.web, "run_app", lambda app, **kwargs: given.update(kwargs))
    return given


@pytest.mark.slow
def test_serve_wires_the_tls_context(pki, run_app):
    cli.main(["serve", "--ssl-certfile", str(pki / "server.pem"), "--ssl-keyfile", str(pki / "server.key")])
    context = run_app["ssl_context"]
    assert context.verify_mode == ssl.CERT_NONE and context.minimum_version == ssl.TLSVersion.TLSv1_2
    cli.main(["serve", "--ssl-certfile", str(pki / "server.pem"), "--ssl-keyfile", str(pki / "server.key"),
              "--ssl-ca-certs", str(pki / "ca.pem")])
    assert run_app["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    cli.main(["serve"])
    assert run_app["ssl_context"] is None and server_context(ServeConfig()) is None


# (flags relative to the pki folder, the message after "edge: ", with {pki} for its path)
TLS_MISTAKES = [
    (["--ssl-keyfile", "server.key"], "ssl_certfile is not set: HTTPS needs a certificate and its key together"),
    (["--ssl-certfile", "server.pem"], "ssl_keyfile is not set: HTTPS needs a certificate and its key together"),
    (["--ssl-ca-certs", "ca.pem"], "ssl_certfile is not set"),
    (["--ssl-certfile", "absent.pem", "--ssl-keyfile", "server.key"],
     "ssl_certfile {pki}/absent.pem: cannot read the file: No such file or directory"),
    (["--ssl-certfile", "server.pem", "--ssl-keyfile", "."], "ssl_keyfile {pki}: cannot read the file: Is a directory"),
    (["--ssl-certfile", "server.key", "--ssl-keyfile", "server.pem"],
     "ssl_certfile {pki}/server.key: no PEM certificate in the file"),
    (["--ssl-certfile", "server.pem", "--ssl-keyfile", "client.key"],
     "ssl_keyfile {pki}/client.key is not the private key of the certificate in ssl_certfile {pki}/server.pem"),
    (["--ssl-certfile", "server.pem", "--ssl-keyfile", "encrypted.key"],
     "ssl_keyfile {pki}/encrypted.key: the key is encrypted; a service cannot type its passphrase"),
    (["--ssl-certfile", "server.pem", "--ssl-keyfile", "server.key", "--ssl-ca-certs", "absent.pem"],
     "ssl_ca_certs {pki}/absent.pem: cannot read the file: No such file or directory"),
    (["--ssl-certfile", "server.pem", "--ssl-keyfile", "server.key", "--ssl-ca-certs", "ca.key"],
     "ssl_ca_certs {pki}/ca.key: no PEM CA certificate in the file"),
]


@pytest.mark.parametrize("flags,message", TLS_MISTAKES, ids=[m[1].split(":")[0][:40] for m in TLS_MISTAKES])
def test_tls_mistakes_stop_serve_with_one_clear_line(pki, run_app, flags, message):
    flags = [flag if flag.startswith("--") else str(pki / flag) for flag in flags]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", *flags])
    text = str(exit_.value.code)  # sys.exit(str): Python prints it to stderr and exits with status 1
    assert text.startswith("edge: " + message.format(pki=pki)) and "\n" not in text
    assert not run_app  # refused before anything starts


# tests/edge/test_config.py checks each message of load_config; this checks `edge serve` stops with it
BAD_CONFIGS = [
    ("port = \n", "serve.toml:1: (syntax): not valid TOML"),
    ("colour = 1\n", "serve.toml:1: colour: unknown key"),
    ('device = "tpu"\n', "serve.toml:1: device: expected one of ['auto', 'cpu', 'cuda'], got 'tpu'"),
    ('policy = "absent.toml"\n', "absent.toml: (file): cannot read the file: No such file or directory"),
]


@pytest.mark.parametrize("text,message", BAD_CONFIGS, ids=["syntax", "unknown key", "bad value", "no policy file"])
def test_a_bad_config_stops_serve_with_one_clear_line(tmp_path, run_app, text, message):
    (tmp_path / "serve.toml").write_text(text)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--config", str(tmp_path / "serve.toml")])
    text = str(exit_.value.code)
    assert text.startswith(f"edge: {tmp_path}/{message}") and "\n" not in text
    assert not run_app


def test_an_expired_or_expiring_certificate_is_warned_about_at_start(pki, caplog):
    from edge.http.tls import warn_if_expiring
    cert = str(pki / "server.pem")  # valid for 2 days from now
    assert warn_if_expiring(cert, now=time.time() - 30 * 86400) is None
    with caplog.at_level("WARNING", logger="edge.http.tls"):
        assert "in 2.0 days: renew it" in warn_if_expiring(cert)
        assert "expired on" in warn_if_expiring(cert, now=time.time() + 5 * 86400)
    assert len(caplog.records) == 2
