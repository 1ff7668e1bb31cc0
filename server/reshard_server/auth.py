"""Who is asking, and what they may do: principals, scopes, roots and quotas.

Two sources of principals, both optional:

* ``RESHARD_TOKEN``: one shared secret; whoever holds it is ``admin`` with every scope
  (the single-team set-up, and what a server without an auth file does).
* ``RESHARD_AUTH_FILE``: a YAML file the operator owns, one entry per user::

      users:
        alice:
          scopes: [read, submit, cancel]   # read, submit, cancel, admin
          roots: [/data/alice]             # within RESHARD_ROOTS; omitted: all of them
          max_running: 1                   # omitted: the server's RESHARD_MAX_RUNNING
          max_queued: 4                    # omitted: the server's RESHARD_MAX_QUEUED
          tokens:
            - {id: 3f2a9c1b, sha256: <hex of the token's SHA-256>, created: <ISO time>}

  Tokens are stored only as SHA-256 hashes (a token is 32 random bytes, so no salt or
  slow hash is needed); ``reshard-server token add`` prints a new one once. The file is
  read again whenever it changes, so ``token revoke`` takes effect on the next request.

Scopes: ``read`` (list and follow jobs and watches, logs, inspect checkpoints, plan),
``submit`` (jobs and watches), ``cancel`` (jobs, unwatch), ``admin`` (all of them, on every
user's jobs, and the audit log). A user sees only their own jobs: another user's job is a
404, as if it did not exist.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import tempfile
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "ADMIN",
    "SCOPES",
    "AuthFile",
    "AuthFileError",
    "Principal",
    "hash_token",
    "new_token",
]

SCOPES = ("read", "submit", "cancel", "admin")
ADMIN = "admin"
TOKEN_PREFIX = "rsk_"


class AuthFileError(Exception):
    """The auth file cannot be used; the message names the entry to fix."""


@dataclass(frozen=True, kw_only=True)
class Principal:
    """An authenticated caller: its name, scopes, roots (None: every server root) and
    quotas (None: the server's)."""

    name: str
    scopes: frozenset[str]
    roots: tuple[str, ...] | None = None
    max_running: int | None = None
    max_queued: int | None = None
    via: str = "token"  # token, shared-token or jwt

    @property
    def admin(self) -> bool:
        return ADMIN in self.scopes

    def may(self, scope: str) -> bool:
        return self.admin or scope in self.scopes


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> tuple[str, str]:
    """A fresh token and its id: ``rsk_<id>_<secret>`` (the id is public, for revoking)."""
    token_id = secrets.token_hex(4)
    return f"{TOKEN_PREFIX}{token_id}_{secrets.token_urlsafe(32)}", token_id


@dataclass(kw_only=True)
class _Loaded:
    stamp: tuple[int, int, int] | None = None
    by_hash: dict[str, tuple[str, str]] = field(default_factory=dict)  # hash -> (user, id)
    users: dict[str, Principal] = field(default_factory=dict)
    error: str | None = None


class AuthFile:
    """The operator's users file: read on first use and again whenever it changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._loaded = _Loaded()

    # ---- reading

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> _Loaded:
        stamp = self._stamp()
        with self._lock:
            if stamp != self._loaded.stamp or self._loaded.stamp is None:
                self._loaded = self._read(stamp)
            return self._loaded

    def _read(self, stamp: tuple[int, int, int] | None) -> _Loaded:
        if stamp is None:
            return _Loaded(stamp=None, error=f"{self.path} does not exist")
        try:
            data = parse(Path(self.path).read_text(), self.path)
        except AuthFileError as e:
            # a broken file refuses every token from it (never a stale, wider set)
            return _Loaded(stamp=stamp, error=str(e))
        loaded = _Loaded(stamp=stamp)
        for name, entry in data["users"].items():
            loaded.users[name] = Principal(
                name=name,
                scopes=frozenset(entry["scopes"]),
                roots=tuple(entry["roots"]) if entry.get("roots") is not None else None,
                max_running=entry.get("max_running"),
                max_queued=entry.get("max_queued"),
            )
            for tok in entry["tokens"]:
                loaded.by_hash[tok["sha256"]] = (name, tok["id"])
        return loaded

    def authenticate(self, token: str) -> Principal | None:
        """The user ``token`` belongs to, or None (unknown, revoked, or the file broken)."""
        loaded = self.current()
        digest = hash_token(token)
        # looked up by the token's SHA-256, never by the token: timing can tell only about
        # the digest, which reveals nothing of the secret
        hit = loaded.by_hash.get(digest)
        return loaded.users[hit[0]] if hit is not None else None

    def user(self, name: str) -> Principal | None:
        """User ``name`` as the file has them now (None once removed)."""
        return self.current().users.get(name)

    @property
    def error(self) -> str | None:
        return self.current().error

    # ---- editing (the ``reshard-server token`` commands)

    def load_raw(self) -> dict[str, Any]:
        try:
            text = Path(self.path).read_text()
        except FileNotFoundError:
            return {"users": {}}
        return parse(text, self.path)

    def save_raw(self, data: dict[str, Any]) -> None:
        """Write the file atomically, readable by its owner only."""
        parse(yaml.safe_dump(data), self.path)  # never write what could not be read back
        folder = Path(self.path).resolve().parent
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".auth-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(HEADER)
                yaml.safe_dump(data, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def add_token(
        self,
        user: str,
        scopes: list[str],
        roots: list[str] | None,
        max_running: int | None,
        max_queued: int | None,
    ) -> tuple[str, str]:
        """A new token for ``user`` (created, or updated with these settings); returns
        (token, id). Only the hash is kept."""
        data = self.load_raw()
        entry = data["users"].setdefault(user, {"tokens": []})
        entry["scopes"] = sorted(set(scopes))
        for key, value in (
            ("roots", roots),
            ("max_running", max_running),
            ("max_queued", max_queued),
        ):
            if value is not None:
                entry[key] = value
        token, token_id = new_token()
        entry["tokens"].append(
            {
                "id": token_id,
                "sha256": hash_token(token),
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
            }
        )
        self.save_raw(data)
        return token, token_id

    def revoke(self, token_id: str) -> str:
        """Remove the token with ``token_id``; returns its user. KeyError when none has it."""
        data = self.load_raw()
        for user, entry in data["users"].items():
            kept = [t for t in entry["tokens"] if t["id"] != token_id]
            if len(kept) != len(entry["tokens"]):
                entry["tokens"] = kept
                self.save_raw(data)
                return str(user)
        raise KeyError(token_id)


HEADER = (
    "# reshard-server users and their tokens (SHA-256 hashes only).\n"
    "# Edit with `reshard-server token add/list/revoke`, or by hand; read again on change.\n"
)


def parse(text: str, where: str) -> dict[str, Any]:
    """The auth file's content, checked: users with known scopes, roots, quotas and tokens."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise AuthFileError(f"{where} is not valid YAML: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("users", {}), dict):
        raise AuthFileError(f"{where}: top level must be a mapping with a 'users' mapping")
    users = data.setdefault("users", {})
    seen_ids: set[str] = set()
    for name, entry in users.items():
        uw = f"{where}: users[{name!r}]"
        if (
            not isinstance(name, str)
            or not name
            or not name.replace("-", "")
            .replace("_", "")
            .replace(".", "")
            .replace("@", "")
            .isalnum()
        ):
            raise AuthFileError(f"{uw}: a user name is letters, digits and - _ . @")
        if name == ADMIN:
            raise AuthFileError(
                f"{uw}: 'admin' is the RESHARD_TOKEN holder's name; give the user another "
                "name and the admin scope"
            )
        if not isinstance(entry, dict):
            raise AuthFileError(f"{uw} must be a mapping")
        scopes = entry.get("scopes")
        if not isinstance(scopes, list) or not scopes or not set(scopes) <= set(SCOPES):
            raise AuthFileError(f"{uw}.scopes must list some of {', '.join(SCOPES)}")
        roots = entry.get("roots")
        if roots is not None and (
            not isinstance(roots, list) or not all(isinstance(r, str) and r for r in roots)
        ):
            raise AuthFileError(f"{uw}.roots must be a list of paths or URI prefixes")
        for key in ("max_running", "max_queued"):
            v = entry.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise AuthFileError(f"{uw}.{key} must be a non-negative integer")
        tokens = entry.setdefault("tokens", [])
        if not isinstance(tokens, list):
            raise AuthFileError(f"{uw}.tokens must be a list")
        for i, tok in enumerate(tokens):
            tw = f"{uw}.tokens[{i}]"
            if not isinstance(tok, dict):
                raise AuthFileError(f"{tw} must be a mapping with id and sha256")
            digest, tid = tok.get("sha256"), tok.get("id")
            if not (
                isinstance(digest, str)
                and len(digest) == 64
                and all(c in "0123456789abcdef" for c in digest)
            ):
                raise AuthFileError(f"{tw}.sha256 must be 64 lowercase hex characters")
            if not isinstance(tid, str) or not tid or tid in seen_ids:
                raise AuthFileError(f"{tw}.id must be a unique string")
            seen_ids.add(tid)
    return data


#: signatures a JWT may carry: asymmetric only (an HMAC "signed" with a public key, and
#: ``alg: none``, are refused by construction)
JWT_ALGORITHMS = [
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
]
SCOPE_PREFIX = "reshard:"


class JwtVerifier:
    """Bearer JWTs from the organisation's identity provider: signature (a key of the
    issuer's JWKS, by ``kid``), issuer, audience, expiry; the user from ``user_claim`` and
    scopes from ``scopes_claim`` values ``reshard:<scope>``."""

    def __init__(
        self, issuer: str, audience: str, jwks: str, user_claim: str, scopes_claim: str
    ) -> None:
        import jwt

        self.issuer, self.audience = issuer, audience
        self.user_claim, self.scopes_claim = user_claim, scopes_claim
        if not (issuer and audience and jwks):
            raise AuthFileError(
                "JWTs need RESHARD_JWT_ISSUER, RESHARD_JWT_AUDIENCE and RESHARD_JWT_JWKS"
            )
        if jwks.startswith(("https://", "http://")):
            self._client: Any = jwt.PyJWKClient(jwks, cache_keys=True, lifespan=300)
            self._keys: Any = None
        else:
            import json

            self._client = None
            self._keys = jwt.PyJWKSet.from_dict(json.loads(Path(jwks).read_text()))

    def _key(self, token: str) -> Any:
        import jwt

        if self._client is not None:
            return self._client.get_signing_key_from_jwt(token).key
        kid = jwt.get_unverified_header(token).get("kid")
        for k in self._keys.keys:
            if k.key_id == kid:
                return k.key
        raise jwt.InvalidTokenError(f"unknown key id {kid!r}")

    def verify(self, token: str) -> Principal | None:
        """The principal of a valid token, or None (any failure: bad signature, expired,
        wrong issuer or audience, unknown key, an algorithm we do not accept)."""
        import jwt

        try:
            claims = jwt.decode(
                token,
                self._key(token),
                algorithms=JWT_ALGORITHMS,
                audience=self.audience,
                issuer=self.issuer,
                options={"require": ["exp", "iss", "aud"]},
            )
        except (jwt.PyJWTError, ValueError, KeyError):
            return None
        user = claims.get(self.user_claim)
        raw = claims.get(self.scopes_claim, [])
        values = raw.split() if isinstance(raw, str) else raw if isinstance(raw, list) else []
        scopes = {
            v[len(SCOPE_PREFIX) :]
            for v in values
            if isinstance(v, str) and v.startswith(SCOPE_PREFIX)
        }
        scopes &= set(SCOPES)
        if not isinstance(user, str) or not user or not scopes:
            return None
        return Principal(name=user, scopes=frozenset(scopes), via="jwt")


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and token.startswith("eyJ")


def jwt_verifier(settings: Any) -> JwtVerifier | None:
    """The verifier ``RESHARD_JWT_*`` configure, or None when no issuer is set."""
    if not settings.jwt_issuer:
        return None
    return JwtVerifier(
        settings.jwt_issuer,
        settings.jwt_audience,
        settings.jwt_jwks,
        settings.jwt_user_claim,
        settings.jwt_scopes_claim,
    )


def owner_principal(name: str, auth: AuthFile | None, jwt: JwtVerifier | None) -> Principal | None:
    """A job's or watch's owner as they are now: the admin, a user of the auth file (None
    once removed: their watch submits nothing), or an identity-provider user (whose token
    was valid when they made the watch)."""
    if name in ("", ADMIN):
        return Principal(name=ADMIN, scopes=frozenset({ADMIN}), via="shared-token")
    who = auth.user(name) if auth is not None else None
    if who is None and jwt is not None:
        return Principal(name=name, scopes=frozenset({"submit"}), via="jwt")
    return who
