"""API keys and tenants: which key a request holds, the prefix-cache salt that keeps keys apart, and the
throttle on wrong keys.

Keys come from --api-key (one) and --api-key-file (one per line: `name:key`, or a bare key; blank lines and
lines starting with # are skipped). The file is read again when it changes (checked at most once per
RELOAD_CHECK_S), so a key removed from it stops working within a second, without a restart; a file that
cannot be read or parsed then keeps the keys it held before (and says so in the log).

A key's tenant is its name, or `key-<hash prefix>` for a bare key (never the key itself). Keys with the
same name are one tenant (the old and new key during a rotation). Each tenant's requests get their own
prefix cache: the tenant is mixed into every request's cache salt (with the request's own `cache_salt`),
so another key's cached prefix is never found, never counted in `cached_tokens`, and never saves it time.
--share-prefix-cache-across-keys turns that off (then only `cache_salt` separates requests).

Wrong keys are throttled per client address (an IPv6 address by its /64): --auth-failures-per-minute
wrong keys, refilled evenly over the minute; past them, every request from that address that brings a key
gets 429 with Retry-After until one is refilled, before its key is compared (a guess then learns nothing).
The table of addresses is bounded (MAX_ADDRESSES, least recently seen forgotten first).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from pagedserve.api.errors import ApiError, unauthorized
from pagedserve.common.config import ApiConfig
from pagedserve.common.log import get_logger

log = get_logger(component="api")

RELOAD_CHECK_S = 1.0
MAX_KEY_FILE_BYTES = 1 << 20
MAX_ADDRESSES = 65536  # the failure table's size: ~100 bytes an entry
NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")  # a key's name in the key file


class KeyFileError(ValueError):
    """The key file cannot be read or holds a bad line (at start: a configuration error, exit code 2)."""


@dataclass(frozen=True)
class Tenant:
    """Who a request's key belongs to."""

    name: str  # the key's name in the key file, or key-<12 hex of SHA-256(key)>
    key_digest: bytes  # SHA-256 of the key: what dashboard sessions remember (a removed key ends them)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _tenant(name: str, key: str) -> Tenant:
    digest = _digest(key.encode("utf-8", "surrogatepass"))
    return Tenant(name or "key-" + hashlib.sha256(b"pagedserve tenant\0" + digest).hexdigest()[:12], digest)


def parse_key_file(text: str, where: str = "the key file") -> list[Tenant]:
    """The tenants of a key file's text. A line `name:key` names its key when `name` is 1-64 letters,
    digits or `_.@-`; any other line is a bare key (a key holding ':' needs a name). Raises KeyFileError."""
    tenants: dict[bytes, Tenant] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        if not (sep and NAME.fullmatch(name) and key.strip()):
            name, key = "", line
        tenant = _tenant(name, key.strip())
        if tenant.key_digest in tenants and tenants[tenant.key_digest].name != tenant.name:
            raise KeyFileError(f"{where}, line {number}: the same key is given two names")
        tenants[tenant.key_digest] = tenant
    return list(tenants.values())


class ApiKeys:
    """The keys that open the api: --api-key and --api-key-file's, the file re-read when it changes."""

    def __init__(self, api_key: str, key_file: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._fixed = [_tenant("", api_key)] if api_key else []
        self._path = os.path.expanduser(key_file) if key_file else ""
        self._clock = clock
        self._stamp = b""  # SHA-256 of the file's bytes last loaded
        self._checked = -math.inf
        self._error = ""  # the last reload's problem, logged once
        self._by_digest: dict[bytes, Tenant] = {t.key_digest: t for t in self._fixed}
        if self._path:
            self._reload(at_start=True)

    @property
    def enabled(self) -> bool:
        """Whether keys are required at all (with a key file, even one that lists none now)."""
        return bool(self._fixed or self._path)

    def match(self, key: bytes) -> Tenant | None:
        """The tenant of `key`, or None. A lookup by the key's SHA-256: its time says nothing of the key."""
        self._maybe_reload()
        return self._by_digest.get(_digest(key))

    def holds(self, tenant: Tenant) -> bool:
        """Whether `tenant`'s key still opens the api (for sessions signed in with it)."""
        self._maybe_reload()
        return self._by_digest.get(tenant.key_digest) == tenant

    def _maybe_reload(self) -> None:
        if self._path and self._clock() - self._checked >= RELOAD_CHECK_S:
            self._reload(at_start=False)

    def _reload(self, at_start: bool) -> None:
        self._checked = self._clock()
        try:
            # Its bytes, not its mtime: two writes within one clock tick leave the same mtime and size.
            with open(self._path, "rb") as f:
                data = f.read(MAX_KEY_FILE_BYTES + 1)
            if len(data) > MAX_KEY_FILE_BYTES:
                raise KeyFileError(f"{self._path} is larger than {MAX_KEY_FILE_BYTES} bytes")
            stamp = hashlib.sha256(data).digest()
            if stamp == self._stamp:
                return
            tenants = parse_key_file(data.decode("utf-8"), self._path)
        except (OSError, UnicodeDecodeError, KeyFileError) as e:
            if at_start:
                raise KeyFileError(f"--api-key-file: {e}") from None
            if str(e) != self._error:  # once per new problem, not once per check
                log.error("api_key_file_unusable", path=self._path, error=str(e), keeps=len(self._by_digest))
            self._error = str(e)
            return
        self._error = ""
        self._stamp = stamp
        self._by_digest = {t.key_digest: t for t in self._fixed + tenants}
        log.info("api_keys_loaded", path=self._path, keys=len(self._by_digest))


def address_of(request: web.Request) -> str:
    """The client's address as the throttle counts it: IPv4 as is, IPv6 by its /64 (one host holds a whole
    /64). The socket's peer: behind a proxy, that is the proxy (X-Forwarded-For is not trusted)."""
    remote = request.remote or ""
    try:
        ip = ipaddress.ip_address(remote)
    except ValueError:
        return remote[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class FailureLimiter:
    """Wrong keys per client address, as a token bucket of `per_minute` refilled evenly; a bounded LRU
    table (an address forgotten has its full allowance again)."""

    def __init__(
        self, per_minute: int, max_addresses: int = MAX_ADDRESSES, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_minute = per_minute
        self.max_addresses = max_addresses
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, at)

    def _tokens(self, address: str) -> float:
        tokens, at = self._buckets.get(address, (self.per_minute, 0.0))
        return min(self.per_minute, tokens + (self._clock() - at) * self.per_minute / 60.0)

    def retry_after_s(self, address: str) -> int:
        """0 when `address` may try a key now, else the whole seconds until it may."""
        if self.per_minute <= 0 or address not in self._buckets:
            return 0
        missing = 1.0 - self._tokens(address)
        return 0 if missing <= 0 else max(1, math.ceil(missing * 60.0 / self.per_minute))

    def failed(self, address: str) -> None:
        if self.per_minute <= 0:
            return
        self._buckets[address] = (self._tokens(address) - 1.0, self._clock())
        self._buckets.move_to_end(address)
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)


def too_many_failures(retry_after_s: int) -> ApiError:
    """OpenAI's 429 shape, with Retry-After."""
    message = f"Too many wrong API keys from this address; retry in {retry_after_s} s."
    return ApiError(
        429, message, type="requests", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)}
    )


class Auth:
    """The api's keys and its throttle on wrong ones; what the middleware and the dashboard ask."""

    def __init__(self, config: ApiConfig) -> None:
        self.keys = ApiKeys(config.api_key, config.api_key_file)
        self.limiter = FailureLimiter(config.auth_failures_per_minute)
        self.share_prefix_cache = config.share_prefix_cache_across_keys
        if not self.keys.enabled:
            log.warning(
                "api_open", reason="no API key: every client may use the api, and all are one tenant, whose "
                "requests share prefix-cache entries unless a request's cache_salt divides them",
            )  # fmt: skip

    def check(self, request: web.Request, key: bytes) -> Tenant:
        """The tenant of `key` sent by `request`'s client; raises 429 (too many wrong keys from its address,
        whatever `key` is) or 401 (a wrong key, counted)."""
        address = address_of(request)
        wait_s = self.limiter.retry_after_s(address)
        if wait_s:
            raise too_many_failures(wait_s)
        tenant = self.keys.match(key)
        if tenant is None:
            self.limiter.failed(address)
            raise unauthorized(given=True)
        return tenant

    def cache_salt(self, tenant: Tenant | None, cache_salt: str) -> str:
        """The salt a request's prefix-cache entries are made under: the request's own `cache_salt`, within
        its tenant's (the length prefix keeps every (tenant, salt) pair apart from every other)."""
        if tenant is None or self.share_prefix_cache:
            return cache_salt
        return f"tenant:{len(tenant.name)}:{tenant.name}:{cache_salt}"


AUTH = web.AppKey("auth", Auth)
TENANT: web.RequestKey[Tenant] = web.RequestKey("tenant", Tenant)  # set when the request brought a key


def bearer_key(request: web.Request) -> bytes | None:
    """The `Authorization: Bearer` key, else the `x-api-key` one (Anthropic's clients send it there), or
    None when there is none."""
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        token = request.headers.get("x-api-key", "")
    if not token.strip():
        return None
    return token.strip().encode("utf-8", "surrogatepass")


def request_cache_salt(request: web.Request, cache_salt: str) -> str:
    """The salt to submit `request`'s sequences under (its tenant's, with its own `cache_salt`)."""
    return request.app[AUTH].cache_salt(request.get(TENANT), cache_salt)
