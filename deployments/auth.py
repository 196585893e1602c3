"""Who is calling: bearer tokens -> principals (admin, advertiser, reader).

Tokens look like `<name>.<secret>` (the secret is 32 random bytes, URL-safe base64). The token file
stores, per name, a random salt and HMAC-SHA256(salt, token), never the token: a leaked file gives no
usable token. The secrets are random 256-bit values, so a fast keyed hash is enough (a slow password
hash would only cost CPU on every request). Verification looks the name up and compares the hash in
constant time (an unknown name costs the same hash). ANDROMEDA_WRITE_TOKEN (any string; final line endings, as a
Secret made from a file has, are dropped: no header carries one) is always an admin token. The file is re-read, without a restart, when its modification time or size changes
(checked at most every `reload_s`); a file that fails to parse keeps the previous tokens (logged).

File format (JSON):

    {"tokens": [{"name": "acme-ci", "role": "advertiser", "advertiser_id": 7,
                 "salt": "<hex>", "hash": "<hex>"}, ...]}

A key named twice in one object, or a key not shown here, is refused naming it (of two values of one key, parsers
keep different ones: `"role": "reader", "role": "admin"` must not be an admin token to anyone).

Roles: `admin` (any write, any read), `advertiser` (writes to its own ads only; reads), `reader` (reads).
Nothing here logs a token, a hash or an Authorization header.
"""
from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from andromeda_core import strict_json
from andromeda_core.errors import InvalidInput

log = logging.getLogger(__name__)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # whole names only (fullmatch: "$" would let a final newline in)
ENTRY_KEYS = {"name", "role", "advertiser_id", "salt", "hash"}
Role = Literal["admin", "advertiser", "reader"]
ROLES = ("admin", "advertiser", "reader")


@dataclass(frozen=True)
class Principal:
    """The caller a valid token names."""

    name: str
    role: Role
    advertiser_id: int | None = None  # set for role advertiser only

    @property
    def can_write(self) -> bool:
        return self.role in ("admin", "advertiser")


ENV_ADMIN = Principal("admin", "admin")  # ANDROMEDA_WRITE_TOKEN's (a token file may name a token "admin" too)


@dataclass(frozen=True)
class TokenEntry:
    principal: Principal
    salt: bytes
    digest: bytes


def token_hash(salt: bytes, token: str) -> bytes:
    return hmac.new(salt, token.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()


class TokenFileError(ValueError):
    """The token file is not what the module docstring describes; `field` names where."""

    def __init__(self, message: str, field: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def parse_token_file(text: str) -> dict[str, TokenEntry]:
    """The file's entries by name; raises TokenFileError naming the first bad field."""
    try:
        data = strict_json.read(text, "token_file")  # a key twice ("role": "reader", "role": "admin") is refused
    except InvalidInput as exc:
        raise TokenFileError(exc.message, exc.field) from None
    if not isinstance(data, dict) or set(data) != {"tokens"} or not isinstance(data["tokens"], list):
        raise TokenFileError('expected {"tokens": [...]} and nothing else', "tokens")
    entries: dict[str, TokenEntry] = {}
    for i, item in enumerate(data["tokens"]):
        where = f"tokens[{i}]"
        if not isinstance(item, dict):
            raise TokenFileError("expected an object", where)
        if unknown := sorted(set(item) - ENTRY_KEYS):
            raise TokenFileError(f"unknown key (an entry has {', '.join(sorted(ENTRY_KEYS))})", f"{where}.{unknown[0]}")
        name, role, advertiser = item.get("name"), item.get("role"), item.get("advertiser_id")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise TokenFileError("must be 1-64 letters, digits, '_' or '-'", f"{where}.name")
        if name in entries:
            raise TokenFileError(f"duplicate name {name}", f"{where}.name")
        if role not in ROLES:
            raise TokenFileError(f"must be one of {', '.join(ROLES)}", f"{where}.role")
        if role == "advertiser":
            if not isinstance(advertiser, int) or isinstance(advertiser, bool) or not 0 <= advertiser < 2**63:
                raise TokenFileError("an advertiser token needs an integer advertiser_id", f"{where}.advertiser_id")
        elif advertiser is not None:
            raise TokenFileError(f"only advertiser tokens have one (role {role})", f"{where}.advertiser_id")
        try:
            salt, digest = bytes.fromhex(item["salt"]), bytes.fromhex(item["hash"])
        except (KeyError, TypeError, ValueError):
            raise TokenFileError("salt and hash must be hex strings", where) from None
        if len(salt) < 16 or len(digest) != 32:
            raise TokenFileError("salt must be >= 16 bytes and hash 32 bytes (HMAC-SHA256)", where)
        entries[name] = TokenEntry(Principal(name, role, advertiser), salt, digest)
    return entries


def new_token(name: str, role: Role, advertiser_id: int | None = None) -> tuple[str, dict]:
    """(token, file entry): the token is shown once to whoever asked for it; only the entry is stored."""
    if not NAME.fullmatch(name):
        raise ValueError("name must be 1-64 letters, digits, '_' or '-'")
    token = f"{name}.{base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip('=')}"
    salt = secrets.token_bytes(16)
    entry = {"name": name, "role": role, **({"advertiser_id": advertiser_id} if role == "advertiser" else {}),
             "salt": salt.hex(), "hash": token_hash(salt, token).hex()}
    parse_token_file(json.dumps({"tokens": [entry]}))  # the same checks as a load
    return token, entry


def add_token(path: str | Path, name: str, role: Role, advertiser_id: int | None = None) -> str:
    """Add (or replace) `name` in the token file at `path` (created if missing), written atomically so a
    router never reads half a file; returns the new token."""
    path = Path(path)
    if path.is_dir():  # refused before its lock file is made beside it
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if path.exists():
        parse_token_file(path.read_text())  # likewise; read again under the lock
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:  # two runs at once: one waits (else one's entry
        fcntl.flock(lock, fcntl.LOCK_EX)  # was lost: each read the file before the other wrote it)
        text = path.read_text() if path.exists() else '{"tokens": []}'
        parse_token_file(text)
        tokens = json.loads(text)["tokens"]
        token, entry = new_token(name, role, advertiser_id)
        tokens = [t for t in tokens if t["name"] != name] + [entry]
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"tokens": tokens}, indent=1) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    return token


_DUMMY = TokenEntry(Principal("-", "reader"), b"\0" * 16, b"\0" * 32)


class TokenStore:
    """Verifies bearer tokens against ANDROMEDA_WRITE_TOKEN (admin) and the token file (reloaded when it
    changes). Thread-safe."""

    def __init__(self, admin_token: str | None, token_file: str | None, reload_s: float = 2.0):
        self.admin_digest = hashlib.sha256(admin_token.encode("utf-8", "surrogatepass")).digest() if admin_token else None
        self.path = Path(token_file) if token_file else None
        self.reload_s = reload_s
        self.entries: dict[str, TokenEntry] = {}
        self.reloads, self.reload_errors = 0, 0
        self._seen: tuple | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if self.path is not None:
            self._load(strict=True)  # a bad file at start is a failed start, not a silent empty one

    @property
    def writes_enabled(self) -> bool:
        return self.admin_digest is not None or self.path is not None

    def _load(self, strict: bool) -> None:
        try:
            stat = self.path.stat()
            seen = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if seen == self._seen:
                return
            entries = parse_token_file(self.path.read_text())
        except (OSError, TokenFileError) as exc:
            if strict:
                raise
            self.reload_errors += 1
            log.error("token file %s not reloaded, keeping the previous tokens: %s", self.path,
                      exc.strerror if isinstance(exc, OSError) else exc)
            return
        self.entries, self._seen = entries, seen
        self.reloads += 1
        log.info("token file %s loaded: %d tokens", self.path, len(entries))

    def refresh(self, now: float | None = None) -> None:
        """Re-read the file if `reload_s` has passed since the last check and it changed."""
        if self.path is None:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._checked < self.reload_s:
                return
            self._checked = now
            self._load(strict=False)

    def verify(self, token: str) -> Principal | None:
        """The principal of `token`, or None. Constant time in the token's content."""
        self.refresh()
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()  # digests, of one length: the time
        is_admin = self.admin_digest is not None and hmac.compare_digest(digest, self.admin_digest)  # tells no length
        name, dot, _ = token.partition(".")
        entry = self.entries.get(name) if dot else None
        matched = hmac.compare_digest(token_hash((entry or _DUMMY).salt, token), (entry or _DUMMY).digest)
        if is_admin:
            return ENV_ADMIN
        return entry.principal if entry is not None and matched else None
