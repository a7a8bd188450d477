"""The audit log (one JSON line per request, rotated by size, prompt text only when the policy says so) and
per-key token quotas (per UTC day and month, 429 quota_exceeded with Retry-After, kept across policy reloads
and restarts)."""

import hashlib
import json
import os
import time
from datetime import UTC, datetime

import httpx
import pytest
from aiohttp.test_utils import make_mocked_request
from fake_engine_link import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge.api.openai_request import ApiError, parse_request
from edge.app import _enforcer
from edge.config import ServeConfig
from edge.core.gateway import Gateway, key_id
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool
from edge.core.request_record import RequestRecord
from edge.observe.audit import MAX_TEXT_CHARS, AuditLog, RotatingFile, _capped, quota_state_path
from policies.enforcer import PolicyEnforcer, PolicyRejection, RequestFacts
from policies.limits import model_counter
from policies.loader import PolicyError, load_policy, parse_policy
from policies.quota import TokenQuotas
from policies.quota import key_id as quota_key_id
from policies.reloader import PolicyReloader

MODEL = "SmolLM2-135M-Instruct.Q4_1"
POLICY = """version = 1
[[keys]]
key = "k-team"
class = "default"
id = "team-a"
tokens_per_day = 100
tokens_per_month = 250
admin = true
[[keys]]
key = "k-open"
class = "default"
"""
FIELDS = {"time", "request_id", "key_id", "class", "tenant", "model", "kind", "route", "prompt_tokens", "completion_tokens",
          "status", "finish_reason", "http_status", "degradation", "tier", "priority", "client", "ttft_s", "tpot_s",
          "e2e_s", "prompt_sha256"}
JAN_30_23H = datetime(2025, 1, 30, 23, 0, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(api_key="k-team", prompt_tokens=0, completion_tokens=0, text="hello", **changes) -> RequestRecord:
    fields = dict(time=datetime(2025, 3, 4, 5, 6, 7, 890000, tzinfo=UTC).timestamp(), request_id="chatcmpl-1",
                  key_id=key_id(api_key), client_class="default", tenant=None, model=MODEL, kind="chat",
                  client="127.0.0.1", status="finished", finish_reason="stop", http_status=200,
                  prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, degradation=("max_tokens 9->4",),
                  tier="normal", ttft_s=0.123456, tpot_s=0.02, e2e_s=0.5, prompt_text=text)
    return RequestRecord(**{**fields, **changes})


def enforcer_for(text: str = POLICY, clock=None, state_path: str = "") -> PolicyEnforcer:
    return PolicyEnforcer(parse_policy(text, "test.toml"), quotas=TokenQuotas(state_path, clock or Clock(JAN_30_23H)))


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="ascii").splitlines()]


# --- the line ---
def test_a_line_has_every_field_and_names_the_key_by_its_id(tmp_path):
    audit = AuditLog(str(tmp_path / "audit.log"), 1 << 20, 2, enforcer_for())
    audit(record(prompt_tokens=7, completion_tokens=3))
    audit(record(api_key="k-open"))
    audit.close()
    first, second = lines(tmp_path / "audit.log")
    assert set(first) == FIELDS  # no prompt_text: the policy did not ask for it
    assert first["time"] == "2025-03-04T05:06:07.890Z"
    assert (first["key_id"], first["prompt_tokens"], first["completion_tokens"]) == ("team-a", 7, 3)
    assert (first["degradation"], first["ttft_s"], first["e2e_s"]) == (["max_tokens 9->4"], 0.1235, 0.5)
    assert first["prompt_sha256"] == hashlib.sha256(b"hello").hexdigest()
    assert second["key_id"] == key_id("k-open") and second["key_id"].startswith("sha256:")
    assert "k-team" not in (tmp_path / "audit.log").read_text() and "k-open" not in (tmp_path / "audit.log").read_text()
    assert (tmp_path / "audit.log").stat().st_mode & 0o777 == 0o600


def test_prompt_text_is_kept_only_when_the_policy_says_so(tmp_path):
    enforcer = enforcer_for(POLICY + "[audit]\nlog_text = true\n")
    audit = AuditLog(str(tmp_path / "audit.log"), 1 << 20, 2, enforcer)
    audit(record(text="line one\nline two"))
    enforcer.install(parse_policy(POLICY, "test.toml"))  # a reload turns it off again
    audit(record(text="secret"))
    with_text, without = lines(tmp_path / "audit.log")
    assert with_text["prompt_text"] == "line one\nline two"
    assert "prompt_text" not in without and "secret" not in (tmp_path / "audit.log").read_text()


ADVERSARIAL = st.text(alphabet=st.one_of(
    st.characters(codec=None, categories=None),  # any code point, lone surrogates included
    st.sampled_from(["\n", "\r", "\x00", "\u2028", "\u2029", "\ud800", "\udfff", '"', "\\", "\x1b", "\ufeff"])))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=ADVERSARIAL, tenant=st.none() | ADVERSARIAL, model=ADVERSARIAL)
def test_any_prompt_makes_exactly_one_valid_line(tmp_path, prompt, tenant, model):
    path = tmp_path / "fuzz.log"
    before = path.read_bytes().count(b"\n") if path.exists() else 0
    audit = AuditLog(str(path), 1 << 30, 0, enforcer_for(POLICY + "[audit]\nlog_text = true\n"))
    audit(record(text=prompt, tenant=tenant, model=model))
    audit.close()
    raw = path.read_bytes()
    assert raw.count(b"\n") == before + 1 and raw.endswith(b"\n")
    last = json.loads(raw.splitlines()[-1])
    assert (last["prompt_text"], last["tenant"], last["model"]) == (prompt, _capped(tenant), _capped(model))
    expected = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest() if prompt else None
    assert last["prompt_sha256"] == expected


def test_a_huge_prompt_is_one_bounded_line_that_still_identifies_it(tmp_path):
    prompt = ("ünïcödé \n\x00\ud83d " + "x" * 1000) * 2000  # ~2 MB, a lone high surrogate in every chunk
    audit = AuditLog(str(tmp_path / "audit.log"), 4096, 1, enforcer_for(POLICY + "[audit]\nlog_text = true\n"))
    audit(record(text="small"))
    audit(record(text=prompt))
    [entry] = lines(tmp_path / "audit.log")  # a file of its own
    digest = hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()
    assert entry["prompt_text"] == f"{prompt[:MAX_TEXT_CHARS]}...({len(prompt)} chars, sha256:{digest[:16]})"
    assert entry["prompt_sha256"] == digest and (tmp_path / "audit.log").stat().st_size < 8 * MAX_TEXT_CHARS
    assert [entry["prompt_text"] for entry in lines(tmp_path / "audit.log.1")] == ["small"]


def test_huge_model_names_cannot_rotate_a_wrong_key_attempt_out_of_the_log(tmp_path):
    audit = AuditLog(str(tmp_path / "audit.log"), 64 * 1024, 1, enforcer_for())
    audit(record(api_key="wrong", status="failed", http_status=401))
    for _ in range(4):
        audit(record(model="m" * 800_000, status="failed", http_status=400))
    kept = lines(tmp_path / "audit.log")
    assert [entry["http_status"] for entry in kept] == [401, 400, 400, 400, 400]
    digest = hashlib.sha256(b"m" * 800_000).hexdigest()[:16]
    assert kept[-1]["model"] == "m" * 256 + f"...(800000 chars, sha256:{digest})"


# --- rotation ---
def test_rotation_keeps_the_newest_lines_in_backups_files(tmp_path):
    path = tmp_path / "audit.log"
    log = RotatingFile(str(path), 100, 2)
    written = [f'{{"n":{i:04d},"pad":"{"x" * 20}"}}\n'.encode() for i in range(41)]  # 40 bytes: 2 lines a file
    for line in written:
        log.write(line)
    log.close()
    files = [tmp_path / "audit.log.2", tmp_path / "audit.log.1", path]
    kept = b"".join(f.read_bytes() for f in files)
    assert kept == b"".join(written[-len(kept.splitlines()):])  # the newest lines, in order, none cut
    assert len(kept.splitlines()) == 5 and all(f.stat().st_size <= 100 for f in files)
    assert not (tmp_path / "audit.log.3").exists()


def test_a_burst_of_junk_cannot_push_the_kept_days_out(tmp_path):
    """backups = 1 and a day of history: a wrong-key attempt, then far more junk than one backup holds."""
    path = tmp_path / "audit.log"
    audit = AuditLog(str(path), 4096, 1, enforcer_for(), keep_days=1)
    audit(record(api_key="wrong", status="failed", http_status=401))
    for _ in range(200):
        audit(record(model="m" * 100_000, status="failed", http_status=400))
    files = sorted(tmp_path.glob("audit.log*"), key=lambda f: f.stat().st_mtime)
    assert len(files) > 2 and [e["http_status"] for e in lines(files[0])][0] == 401  # all kept: younger than a day
    assert sum(len(lines(f)) for f in files) == 201
    day_ago = time.time() - 2 * 86400  # two days on: past the history, the count applies again
    for f in tmp_path.glob("audit.log.*"):
        os.utime(f, (day_ago, day_ago))
    audit.file.max_bytes = 1  # the next line rotates
    audit(record(status="failed", http_status=400))
    assert sorted(f.name for f in tmp_path.glob("audit.log*")) == ["audit.log", "audit.log.1"]


def test_without_backups_the_log_starts_over(tmp_path):
    log = RotatingFile(str(tmp_path / "audit.log"), 50, 0)
    for i in range(5):
        log.write(f"line {i} {'y' * 20}\n".encode())
    assert (tmp_path / "audit.log").read_text() == f"line 4 {'y' * 20}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.log"]


def test_a_reopened_log_appends_and_counts_what_was_there(tmp_path):
    path = tmp_path / "audit.log"
    RotatingFile(str(path), 60, 1).write(b"a" * 39 + b"\n")
    log = RotatingFile(str(path), 60, 1)  # a restart
    log.write(b"b" * 39 + b"\n")
    assert (tmp_path / "audit.log.1").read_bytes() == b"a" * 39 + b"\n" and path.read_bytes() == b"b" * 39 + b"\n"


def test_an_audit_file_that_was_there_is_made_private_at_start(tmp_path):
    path = tmp_path / "audit.log"
    path.write_bytes(b"an older line\n")
    path.chmod(0o644)  # made by hand, or by a build that let the umask decide
    log = RotatingFile(str(path), 1 << 20, 1)
    assert path.stat().st_mode & 0o777 == 0o600 and log.size == len(b"an older line\n")


@pytest.mark.parametrize("where", ["missing/audit.log", "."])
@pytest.mark.slow
def test_an_audit_log_that_cannot_be_opened_stops_edge_serve(tmp_path, where, monkeypatch):
    from edge import cli
    path = tmp_path / where
    monkeypatch.setattr("logging.basicConfig", lambda **kwargs: None)  # leave pytest's logging alone
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", "--audit-log", str(path), "--port", "0"])
    assert str(stopped.value) in (f"edge: audit_log {path}: cannot open it for appending: No such file or directory",
                                  f"edge: audit_log {path}: cannot open it for appending: Is a directory")
    assert not list(tmp_path.glob("missing"))


# --- quotas ---
def decide(enforcer: PolicyEnforcer, api_key: str = "k-team"):
    return enforcer.decide(RequestFacts(api_key, None, MODEL, "hi", 1, None), {MODEL})


def refusal(enforcer: PolicyEnforcer, api_key: str = "k-team") -> PolicyRejection:
    with pytest.raises(PolicyRejection) as refused:
        decide(enforcer, api_key)
    return refused.value


def test_the_day_quota_refuses_until_utc_midnight_then_the_month_until_the_first():
    clock = Clock(JAN_30_23H)
    enforcer = enforcer_for(clock=clock)
    enforcer.release(decide(enforcer))
    enforcer.count_tokens(record(prompt_tokens=60, completion_tokens=40))  # 100: the day's quota, used up
    over = refusal(enforcer)
    assert (over.status, over.code, over.retry_after_s) == (429, "quota_exceeded", 3600)
    assert over.message == ("key 'team-a' has used 100 tokens, its tokens_per_day quota is 100; it resets at "
                            "2025-01-31T00:00:00Z (UTC midnight)")
    clock.now += 3600  # midnight, a new day
    enforcer.release(decide(enforcer))
    enforcer.count_tokens(record(prompt_tokens=150))  # the month: 250, used up
    over = refusal(enforcer)
    assert over.retry_after_s == 24 * 3600 and "tokens_per_month quota is 250" in over.message
    assert "2025-02-01T00:00:00Z (the first of the month, UTC)" in over.message
    clock.now += 24 * 3600 - 1
    assert refusal(enforcer).retry_after_s == 1
    clock.now += 1  # February
    enforcer.release(decide(enforcer))
    assert enforcer.quotas.current(key_id("k-team")).month_tokens == 0


def test_requests_in_flight_hold_their_tokens_so_neither_n_nor_concurrency_overruns_a_quota():
    enforcer = enforcer_for()  # k-team: 100 tokens a day

    def ask(max_tokens, n=1, text="hi" * 20):  # 40 bytes: a 10-token prompt estimate
        return enforcer.decide(RequestFacts("k-team", None, MODEL, text, max_tokens, None, n), {MODEL})

    with pytest.raises(PolicyRejection) as refused:
        ask(8, n=32)  # 256 tokens of choices
    assert (refused.value.status, refused.value.param) == (429, "max_tokens")
    assert "may use 266 tokens" in refused.value.message and "has 100 left" in refused.value.message
    first, second = ask(30), ask(30)  # 40 + 40 held
    assert enforcer.quotas.held[key_id("k-team")] == 80
    with pytest.raises(PolicyRejection):
        ask(30)  # a third would take it past 100 while the two are in flight
    third = ask(None)  # no max_tokens asked for: lowered to what is left
    assert third.max_tokens == 10 and "max_tokens 256->10 (quota)" in third.notes
    for decision in (first, second, third):
        enforcer.release(decision)
    assert key_id("k-team") not in enforcer.quotas.held
    enforcer.count_tokens(record(prompt_tokens=12, completion_tokens=30))  # the real counts settle the day
    assert enforcer.quotas.current(key_id("k-team")).day_tokens == 42


def test_a_quota_is_per_key_and_a_key_without_one_is_never_refused():
    enforcer = enforcer_for()
    enforcer.count_tokens(record(api_key="k-open", prompt_tokens=10 ** 9))
    enforcer.release(decide(enforcer, "k-open"))
    enforcer.release(decide(enforcer))  # k-team's quota is its own
    enforcer.count_tokens(record(api_key="not-in-the-policy", prompt_tokens=5))
    # made-up keys are not counted; a policy key's use is counted across models and on the model (a per-model quota
    # that a reload adds sees the day's use)
    assert set(enforcer.quotas.usage) == {key_id("k-open"), model_counter(key_id("k-open"), MODEL)}


def test_december_resets_on_the_first_of_january():
    quotas = TokenQuotas(clock=Clock(datetime(2025, 12, 31, 12, tzinfo=UTC).timestamp()))
    quotas.add("k", 5)
    assert quotas.exceeded("k", 0, 5).resets_at == datetime(2026, 1, 1, tzinfo=UTC)
    assert quotas.exceeded("k", 5, 0).retry_after_s == 12 * 3600


def test_the_quota_429_reaches_the_client_with_retry_after_and_is_logged(tmp_path):
    enforcer = enforcer_for()
    enforcer.count_tokens(record(prompt_tokens=100))
    registry = InFlightRegistry()
    gateway = Gateway(ServeConfig(), MODEL, PrefillPool({}, registry, 8), FakeEngine(), registry, Metrics(MODEL),
                      enforcer)
    gateway.observers.append(AuditLog(str(tmp_path / "audit.log"), 1 << 20, 1, enforcer))
    http = make_mocked_request("POST", "/v1/chat/completions", headers={"Authorization": "Bearer k-team"})
    request = parse_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "chat")
    with pytest.raises(ApiError) as refused:
        gateway.admit(http, request)
    gateway.rejected(http, refused.value, request)
    assert refused.value.headers["Retry-After"] == "3600"
    entry, = lines(tmp_path / "audit.log")
    assert (entry["status"], entry["http_status"], entry["finish_reason"]) == ("rejected", 429, "quota_exceeded")
    assert entry["key_id"] == "team-a" and entry["prompt_sha256"] == hashlib.sha256(b"hi").hexdigest()


def test_counts_survive_a_policy_reload(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    enforcer = PolicyEnforcer(load_policy(path), quotas=TokenQuotas(clock=Clock(JAN_30_23H)))
    reloader = PolicyReloader(str(path), enforcer)
    enforcer.count_tokens(record(prompt_tokens=80))
    path.write_text(POLICY.replace("tokens_per_day = 100", "tokens_per_day = 50"))
    assert reloader.reload() is True
    assert "used 80 tokens, its tokens_per_day quota is 50" in refusal(enforcer).message


def test_a_reload_may_not_silently_remove_every_quota(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    reloader = PolicyReloader(str(path), PolicyEnforcer(load_policy(path)))
    unlimited = POLICY.replace("tokens_per_day = 100\n", "").replace("tokens_per_month = 250\n", "")
    path.write_text(unlimited)
    assert reloader.reload() is False and "token quota" in reloader.last_error
    path.write_text('allow_weaker_protection = ["rate_limits"]\n' + unlimited)
    assert reloader.reload() is True


def test_counts_survive_a_restart_and_a_bad_state_file_stops_the_start(tmp_path):
    (tmp_path / "policy.toml").write_text(POLICY)
    config = ServeConfig(audit_log=str(tmp_path / "audit.log"), policy=str(tmp_path / "policy.toml"))
    first = _enforcer(config)
    first.count_tokens(record(prompt_tokens=30, completion_tokens=70))
    restarted = _enforcer(config)  # what edge serve builds at its next start
    assert restarted.quotas.current(key_id("k-team")).day_tokens == 100
    assert refusal(restarted).code == "quota_exceeded"
    state = tmp_path / "audit.log.quotas.json"
    assert quota_state_path(config.audit_log) == str(state) and state.stat().st_mode & 0o777 == 0o600
    state.write_text('{"version": 1, "keys": {"sha256:0": {"day"')  # damaged by hand
    with pytest.raises(ValueError, match="audit.log.quotas.json is not a valid state file .*remove it"):
        _enforcer(config)


def test_a_new_month_drops_the_old_counts_from_the_state_file(tmp_path):
    path = str(tmp_path / "quotas.json")
    TokenQuotas(path, Clock(JAN_30_23H)).add("sha256:aa", 5)
    february = TokenQuotas(path, Clock(datetime(2025, 2, 1, tzinfo=UTC).timestamp()))
    assert february.usage == {}


def test_the_quota_hash_is_the_gateways():
    for key in ("k-team", "ключ", "\ud800"):
        assert quota_key_id(key) == key_id(key)


@pytest.mark.parametrize("entry, message", [
    ("tokens_per_day = -1", "keys[0].tokens_per_day: expected a value >= 0, got -1"),
    ("tokens_per_month = 1.5", "keys[0].tokens_per_month: expected an integer"),
    ("token_per_day = 5", "keys[0].token_per_day: unknown key"),
    ('admin = "yes"', "keys[0].admin: expected true or false"),
    ('id = "sha256:1234"', "keys[0].id: a key id may not start with 'sha256:'"),
    ('id = "a"\n[[keys]]\nkey = "k2"\nclass = "default"\nid = "a"', "keys[1].id: key id 'a' is used twice"),
    ("[audit]\nlog_texts = true", "audit.log_texts: unknown key"),
])
def test_policy_mistakes_in_quotas_ids_and_audit_are_named(entry, message):
    with pytest.raises(PolicyError) as err:
        parse_policy(f'version = 1\n[[keys]]\nkey = "k"\nclass = "default"\n{entry}\n', "p.toml")
    assert message in str(err.value)


def test_the_schema_has_admin_id_and_quotas():
    policy = parse_policy(POLICY + "[audit]\nlog_text = true\n", "p.toml")
    team, other = policy.keys["k-team"], policy.keys["k-open"]
    assert (team.id, team.admin, team.tokens_per_day, team.tokens_per_month) == ("team-a", True, 100, 250)
    assert (other.id, other.admin, other.tokens_per_day, other.tokens_per_month) == ("", False, 0, 0)
    assert policy.audit.log_text and not parse_policy(POLICY, "p.toml").audit.log_text


# --- end to end ---
@pytest.mark.slow
def test_the_real_server_logs_every_request_and_enforces_a_quota(tmp_path):
    from server_process import ServerProcess
    audit = tmp_path / "audit.log"
    policy = POLICY.replace("tokens_per_day = 100", "tokens_per_day = 5") + "[audit]\nlog_text = true\n"
    with ServerProcess(f'audit_log = "{audit}"\nkv_cache_tokens = 2048\n', tmp_path, policy).start() as server:
        def chat(key: str) -> httpx.Response:
            return httpx.post(server.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi\n"}]},
                              timeout=120)
        assert chat("wrong").status_code == 401
        first = chat("k-team")
        assert first.status_code == 200
        over = chat("k-team")  # the first one's prompt alone is over 5 tokens
        assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
        assert 0 < int(over.headers["Retry-After"]) <= 24 * 3600
    wrong, ok, refused = lines(audit)
    assert (wrong["status"], wrong["http_status"], wrong["key_id"]) == ("rejected", 401, key_id("wrong"))
    assert (ok["status"], ok["request_id"], ok["key_id"]) == ("finished", first.json()["id"], "team-a")
    assert ok["prompt_tokens"] == first.json()["usage"]["prompt_tokens"] and ok["prompt_text"] == "Hi\n"
    assert ok["completion_tokens"] == first.json()["usage"]["completion_tokens"] and ok["e2e_s"] > 0
    assert (refused["http_status"], refused["finish_reason"]) == (429, "quota_exceeded")
    state = json.loads((tmp_path / "audit.log.quotas.json").read_text())
    assert state["keys"][key_id("k-team")]["day_tokens"] == first.json()["usage"]["total_tokens"]
