"""Many users on one server: tokens from the operator's auth file, scopes, per-user roots
and quotas, jobs visible only to their owner, round-robin starts, the audit log, revocation
without a restart, and the Host / Origin guards. A real server and real jobs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from reshard_client import ReshardClient
from reshard_client.errors import Forbidden, NotFound, QueueFull, Unauthorized
from reshard_server.api.deps import REFUSAL_AUDIT_INTERVAL_S
from reshard_server.auth import AuthFile, AuthFileError, Principal, parse
from reshard_server.db import JobRow
from reshard_server.jobs import fair_order
from tests.server.conftest import TOKEN, make_tp4, tensors


def token_cli(auth: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reshard_server.main", "token", "--auth-file", str(auth), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def add_user(auth: Path, user: str, *args: str) -> str:
    r = token_cli(auth, "add", user, *args)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert token.startswith("rsk_") and token not in auth.read_text()  # only its hash
    return token


def job_spec(src: str, dst: str) -> dict:
    return {"source": src, "target": dst, "mesh": {"tp": 2}, "workers": 1}


@pytest.fixture
def users(tmp_path, make_server):
    """alice (her own root, at most 2 queued, none running until the test says), bob
    (his own root), and the RESHARD_TOKEN admin; one job at the engine at a time."""
    data = tmp_path / "data"
    for who in ("alice", "bob"):
        (data / who).mkdir(parents=True)
    auth = tmp_path / "auth.yaml"
    tokens = {
        "alice": add_user(
            auth, "alice", "--roots", str(data / "alice"), "--max-queued", "2", "--max-running", "0"
        ),
        "bob": add_user(auth, "bob", "--roots", str(data / "bob")),
        "viewer": add_user(auth, "viewer", "--scopes", "read"),
    }
    assert oct(auth.stat().st_mode & 0o777) == "0o600"
    server = make_server(auth_file=str(auth), max_running="1")
    for who in ("alice", "bob"):
        make_tp4(str(data / who / "src"), str(tmp_path / f"scratch-{who}"), tensors(1))
    return server, auth, data, tokens


def test_each_user_sees_and_touches_only_their_own(users, tmp_path):
    server, auth, data, tok = users
    alice, bob = ReshardClient(server.url, tok["alice"]), ReshardClient(server.url, tok["bob"])
    admin = server.client()
    job = alice.submit(job_spec(str(data / "alice" / "src"), str(data / "alice" / "tp2")))
    assert job.owner == "alice" and job.state.value == "queued"

    # bob: 404 for every read or change of alice's job, and it is not in his list
    for call in (lambda: bob.get(job.id), lambda: bob.logs(job.id), lambda: bob.cancel(job.id)):
        with pytest.raises(NotFound):
            call()
    r = httpx.get(
        f"{server.url}/v1/jobs/{job.id}/events", headers={"Authorization": f"Bearer {tok['bob']}"}
    )
    assert r.status_code == 404
    assert bob.list().total == 0 and alice.list().total == 1
    # the admin sees everyone's, and one user's on request
    assert {j.owner for j in admin.list().items} == {"alice"}
    assert admin.list(owner="bob").total == 0

    # roots: alice cannot read or write under bob's
    with pytest.raises(Forbidden, match="outside user 'alice'"):
        alice.submit(job_spec(str(data / "bob" / "src"), str(data / "alice" / "x")))
    with pytest.raises(Forbidden, match="outside user 'alice'"):
        alice.submit(job_spec(str(data / "alice" / "src"), str(data / "bob" / "x")))
    with pytest.raises(Forbidden, match="outside user 'alice'"):
        alice.checkpoint(str(data / "bob" / "src"))
    assert alice.checkpoint(str(data / "alice" / "src"))["tensors"]

    # scopes: a read-only user lists but cannot submit or cancel
    viewer = ReshardClient(server.url, tok["viewer"])
    assert viewer.list().total == 0
    with pytest.raises(Forbidden, match="lacks the 'submit' scope"):
        viewer.submit(job_spec(str(data / "bob" / "src"), str(data / "bob" / "v")))

    # quotas: alice may queue 2 (her jobs cannot start: max_running 0); the third is a 429
    alice.submit(job_spec(str(data / "alice" / "src"), str(data / "alice" / "tp2b")))
    with pytest.raises(QueueFull, match="max_queued, is 2") as e:
        alice.submit(job_spec(str(data / "alice" / "src"), str(data / "alice" / "tp2c")))
    assert e.value.status == 429
    r = httpx.post(
        f"{server.url}/v1/jobs",
        json=job_spec(str(data / "alice" / "src"), str(data / "alice" / "tp2d")),
        headers={"Authorization": f"Bearer {tok['alice']}"},
    )
    assert r.status_code == 429 and r.headers["Retry-After"]
    waiting = alice.get(job.id)
    assert waiting.state.value == "queued" and "max_running is 0" in (waiting.reason or "")

    # bob's job runs meanwhile: alice's full queue holds nobody else back
    done = bob.wait(
        bob.submit(job_spec(str(data / "bob" / "src"), str(data / "bob" / "tp2"))).id, timeout=300
    )
    assert done.state.value == "succeeded", done.error

    # alice cancels her own job; the admin may cancel anyone's
    assert alice.cancel(job.id).state.value == "cancelled"
    other = alice.list(state="queued").items[0]
    assert admin.cancel(other.id).state.value == "cancelled"

    # revocation: the next request is refused, no restart
    bob_id = tok["bob"].split("_")[1]
    r = token_cli(auth, "revoke", bob_id)
    assert r.returncode == 0, r.stderr
    last = max(e.seq for e in server.client().audit(limit=1000).items)
    started = time.monotonic()
    with pytest.raises(Unauthorized):
        bob.list()
    for _ in range(20):  # a flood of bad tokens: refused, and audited once per address
        assert (
            httpx.get(f"{server.url}/v1/jobs", headers={"Authorization": "Bearer x"}).status_code
            == 401
        )
    windows = int((time.monotonic() - started) // REFUSAL_AUDIT_INTERVAL_S)  # a loaded host
    audited = [e for e in server.client().audit(limit=1000).items if e.action == "authenticate"]
    assert audited, "no refused token was audited"
    refusals = [e for e in audited if e.seq > last]
    assert len(refusals) <= 1 + windows, (len(refusals), windows)  # 21 refused, few audited
    listed = token_cli(auth, "list", "--json")
    assert '"bob"' in listed.stdout and bob_id not in listed.stdout

    # the audit log names every action and its principal, and never a token
    entries = admin.audit(limit=1000).items
    seen = {(e.principal, e.action, e.outcome, e.code) for e in entries}
    assert ("alice", "submit", "ok", 0) in seen
    assert ("alice", "submit", "refused", 403) in seen
    assert ("alice", "submit", "refused", 429) in seen
    assert ("bob", "cancel", "refused", 404) in seen
    assert ("viewer", "need:submit", "refused", 403) in seen
    assert ("alice", "cancel", "ok", 0) in seen and ("admin", "cancel", "ok", 0) in seen
    assert ("", "authenticate", "refused", 401) in seen
    with pytest.raises(Forbidden):
        alice.audit()
    cli = subprocess.run(
        [sys.executable, "-m", "reshard_client.cli", "audit", "--json", "--user", "alice"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RESHARD_URL": server.url, "RESHARD_TOKEN": TOKEN},
    )
    assert cli.returncode == 0 and '"principal": "alice"' in cli.stdout, cli.stderr

    # no token text anywhere the server writes: data dir, database, logs
    secrets_ = [*tok.values(), TOKEN]
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.name != "auth.yaml":
            blob = path.read_bytes()
            for t in secrets_:
                assert t.encode() not in blob, f"a token appears in {path}"


def test_round_robin_start_order_across_users(tmp_path, make_server):
    """One job at the engine at a time: alice queues three, then bob one; bob's starts
    second, not fourth."""
    data = tmp_path / "data"
    auth = tmp_path / "auth.yaml"
    tok = {u: add_user(auth, u) for u in ("alice", "bob")}
    server = make_server(auth_file=str(auth), max_running="1")
    make_tp4(str(data / "src"), str(tmp_path / "scratch"), tensors(1))
    alice, bob = ReshardClient(server.url, tok["alice"]), ReshardClient(server.url, tok["bob"])
    ids = [alice.submit(job_spec(str(data / "src"), str(data / f"a{i}"))).id for i in range(3)]
    ids.append(bob.submit(job_spec(str(data / "src"), str(data / "b0"))).id)
    admin = server.client()
    jobs = [admin.wait(i, timeout=300) for i in ids]
    assert all(j.state.value == "succeeded" for j in jobs), [j.error for j in jobs]
    started = [j.id for j in sorted(jobs, key=lambda j: j.started_at)]
    assert started == [ids[0], ids[3], ids[1], ids[2]]


def test_fair_order_rotates_across_owners():
    def row(i: int, owner: str) -> JobRow:
        return JobRow(
            id=str(i),
            state="queued",
            spec={},
            idem_key=None,
            idem_hash=None,
            created_at=i,
            started_at=None,
            finished_at=None,
            progress={},
            error=None,
            attempts=0,
            cancel_requested=False,
            owner=owner,
        )

    q = [row(1, "a"), row(2, "a"), row(3, "a"), row(4, "b"), row(5, "c")]
    assert [j.id for j in fair_order(q, None)] == ["1", "4", "5", "2", "3"]
    assert [j.id for j in fair_order(q, "a")] == ["4", "5", "1", "2", "3"]
    assert [j.id for j in fair_order(q, "c")] == ["1", "4", "5", "2", "3"]
    assert fair_order([], "a") == []


def test_host_and_origin_guards(server):
    base = server.url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{base}/v1/jobs", headers={**auth, "Host": "evil.example"}).status_code == 421
    assert httpx.get(f"{base}/v1/me", headers={**auth, "Host": "10.1.2.3:8000"}).status_code == 421
    # a kubelet probes /healthz by pod IP: that one answers any Host
    assert httpx.get(f"{base}/healthz", headers={"Host": "10.1.2.3:8000"}).status_code == 200
    r = httpx.post(f"{base}/v1/jobs", json={}, headers={**auth, "Origin": "https://evil.example"})
    assert r.status_code == 403 and "cross-site" in r.text
    r = httpx.post(f"{base}/v1/jobs", json={}, headers={**auth, "Origin": "null"})
    assert r.status_code == 403
    # the same origin and no origin (the CLI, curl) pass on to validation
    same = httpx.post(f"{base}/v1/jobs", json={}, headers={**auth, "Origin": base})
    assert same.status_code == 422
    assert (
        httpx.get(f"{base}/v1/jobs", headers={**auth, "Origin": "https://evil.example"}).status_code
        == 200
    )


def test_auth_file_is_checked_and_a_broken_one_refuses_everyone(tmp_path):
    good = tmp_path / "auth.yaml"
    f = AuthFile(str(good))
    token, tid = f.add_token("carol", ["read"], None, None, None)
    who = f.authenticate(token)
    assert who == Principal(name="carol", scopes=frozenset({"read"}))
    assert f.authenticate(token + "x") is None
    time.sleep(0.01)
    good.write_text(good.read_text().replace("read", "reed"))  # edited by hand, badly
    assert f.authenticate(token) is None and "scopes must list" in (f.error or "")
    for text, msg in (
        ("users: [1]", "'users' mapping"),
        ("users: {admin: {scopes: [read]}}", "RESHARD_TOKEN holder"),
        ("users: {'a b': {scopes: [read]}}", "letters, digits"),
        ("users: {x: {scopes: [read], tokens: [{id: a, sha256: nothex}]}}", "64 lowercase"),
        ("users: {x: {scopes: [read], max_queued: -1}}", "non-negative"),
    ):
        with pytest.raises(AuthFileError, match=msg):
            parse(text, "auth.yaml")
    r = token_cli(tmp_path / "new.yaml", "add", "dave", "--scopes", "read,fly")
    assert r.returncode == 1 and "unknown scope(s) fly" in r.stderr and "Traceback" not in r.stderr
    r = token_cli(tmp_path / "new.yaml", "revoke", "nope")
    assert r.returncode == 1 and "no token with id 'nope'" in r.stderr


def test_jwts_from_an_identity_provider(tmp_path, make_server):
    """Tokens signed by the test's own RSA key (JWKS file): a valid one maps its scope
    claim to scopes; expired, wrong issuer or audience, unknown key id, ``alg: none`` and
    HS256 signed with the public key are all refused."""
    import json

    import jwt
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig", "alg": "RS256"}]}))
    iss, aud = "https://idp.example", "reshard"
    server = make_server(jwt_issuer=iss, jwt_audience=aud, jwt_jwks=str(jwks))
    now = int(time.time())
    good = {
        "iss": iss,
        "aud": aud,
        "sub": "erin",
        "exp": now + 300,
        "scope": "openid reshard:read reshard:submit",
    }

    def sign(claims: dict, k=key, kid: str = "k1", alg: str = "RS256") -> str:
        return jwt.encode(claims, k, algorithm=alg, headers={"kid": kid})

    def status(token: str) -> int:
        return httpx.get(
            f"{server.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}
        ).status_code

    erin = ReshardClient(server.url, sign(good))
    assert erin.list().total == 0
    with pytest.raises(Forbidden, match="'cancel'"):
        erin.cancel("nope")
    assert status(sign({**good, "scope": "openid"})) == 401  # no reshard scope at all
    assert status(sign({**good, "exp": now - 10})) == 401
    assert status(sign({**good, "iss": "https://evil.example"})) == 401
    assert status(sign({**good, "aud": "someone-else"})) == 401
    assert status(sign(good, kid="k2")) == 401
    assert status(sign(good, k=other)) == 401  # right kid, wrong key
    unsigned = jwt.encode(good, None, algorithm="none", headers={"kid": "k1"})
    assert status(unsigned) == 401
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    import base64
    import hashlib
    import hmac as hmac_

    def b64(b: bytes) -> str:
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "k1"}).encode())
    body = b64(json.dumps(good).encode())
    sig = hmac_.new(public_pem, f"{head}.{body}".encode(), hashlib.sha256).digest()
    assert status(f"{head}.{body}.{b64(sig)}") == 401  # HS256 keyed with the public key
    assert status(sign(good)) == 200


def test_readme_users_block(tmp_path, make_server):
    """The README's users block, line by line, as written (paths moved under tmp)."""
    import json

    from tests.support.docs import block

    auth = tmp_path / "users.yaml"
    env = {**os.environ, "RESHARD_TOKEN": TOKEN}
    bindir = Path(sys.executable).parent
    for line in block("users", "bash").strip().splitlines():
        line = line.split("  #")[0].strip()
        if line.startswith("reshard ") and "RESHARD_URL" not in env:  # the server, by now
            env["RESHARD_URL"] = make_server(auth_file=str(auth)).url
        line = line.replace("/etc/reshard/users.yaml", str(auth))
        line = line.replace("/data/alice", str(tmp_path / "data" / "alice"))
        if "TOKEN_ID" in line:
            listed = json.loads(
                subprocess.run(
                    [str(bindir / "reshard-server"), "token", "list", "--json"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            line = line.replace(
                "TOKEN_ID", next(u for u in listed if u["user"] == "alice")["tokens"][0]["id"]
            )
        if line.startswith("export "):
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = value
            continue
        r = subprocess.run(
            ["bash", "-c", line],
            env={**env, "PATH": f"{bindir}:{env['PATH']}"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, (line, r.stderr)
    assert "alice" in auth.read_text() and "oncall" in auth.read_text()
    assert (
        '"tokens": []'
        in subprocess.run(
            [str(bindir / "reshard-server"), "token", "list", "--json"],
            env=env,
            capture_output=True,
            text=True,
        ).stdout
    )
