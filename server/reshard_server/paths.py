"""Which URIs a job may touch: only under the operator's roots.

Refused: fsspec URL chaining (``::``), unknown schemes, ``..`` segments, query strings,
control characters, relative local paths, and local paths whose real location (symlinks
resolved) leaves every local root.
"""

from __future__ import annotations

import os
import re

from reshard_svc.errors import PathNotAllowedError

__all__ = ["REMOTE_SCHEMES", "check_uri", "relative_path"]

REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "memory"})
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _split(uri: str) -> tuple[str, str]:
    m = _SCHEME.match(uri)
    if not m:
        return "", uri
    return m.group(1).lower(), uri[m.end() :]


def _real(path: str) -> str:
    """realpath of ``path``, resolving the deepest existing ancestor (targets may not exist)."""
    path = os.path.abspath(path)
    missing: list[str] = []
    cur = path
    while not os.path.lexists(cur):
        cur, tail = os.path.split(cur)
        missing.append(tail)
        if not tail:
            break
    return os.path.join(os.path.realpath(cur), *reversed(missing))


def _under(path: str, root: str, strict: bool) -> bool:
    if path == root:
        return not strict
    return path.startswith(root.rstrip("/") + "/")


def relative_path(uri: str) -> bool:
    """A local path (no scheme, or ``file://``) that is not absolute."""
    scheme, rest = _split(uri) if isinstance(uri, str) else ("", "")
    return scheme in ("", "file") and bool(rest) and not os.path.isabs(rest)


def check_uri(uri: str, roots: list[str], *, what: str = "uri", write: bool = False) -> str:
    """Return ``uri`` normalized if it lies under a root; raise PathNotAllowedError if not.

    ``write`` requires the URI to be strictly below a root (a conversion writes a sibling
    staging folder next to its target, which must stay inside the root).
    """
    if not isinstance(uri, str) or not uri:
        raise PathNotAllowedError(f"{what} is empty")
    if any(ord(c) < 32 for c in uri):
        raise PathNotAllowedError(f"{what} contains control characters")
    if "::" in uri:
        raise PathNotAllowedError(f"{what} {uri!r}: chained fsspec URLs ('::') are not allowed")
    if "?" in uri or "#" in uri:
        raise PathNotAllowedError(f"{what} {uri!r}: query strings and fragments are not allowed")
    scheme, rest = _split(uri)
    if scheme and scheme != "file" and scheme not in REMOTE_SCHEMES:
        raise PathNotAllowedError(f"{what} {uri!r}: scheme {scheme!r} is not supported")
    if any(seg == ".." for seg in re.split(r"[/\\]", rest)):
        raise PathNotAllowedError(f"{what} {uri!r}: '..' segments are not allowed")
    if not roots:
        raise PathNotAllowedError(
            "the server has no RESHARD_ROOTS configured; every URI is refused"
        )
    if scheme in ("", "file"):
        if not os.path.isabs(rest):
            raise PathNotAllowedError(f"{what} {uri!r}: local paths must be absolute")
        real = _real(rest)
        for root in roots:
            r_scheme, r_rest = _split(root)
            if r_scheme in ("", "file") and _under(real, _real(r_rest), write):
                return real
        raise PathNotAllowedError(f"{what} {uri!r} (really {real}) is outside the allowed roots")
    norm = f"{scheme}://{re.sub(r'/+', '/', rest)}"
    for root in roots:
        r_scheme, r_rest = _split(root)
        if r_scheme == scheme and _under(
            norm.rstrip("/"), f"{r_scheme}://{r_rest}".rstrip("/"), write
        ):
            return norm
    raise PathNotAllowedError(f"{what} {uri!r} is outside the allowed roots")
