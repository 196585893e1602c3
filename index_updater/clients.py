"""The service's Redis clients (the router's publisher and rate limiter, a replica's consumer): each waits a bounded
time for a connection or a reply and retries nothing itself, so that its caller's own tries, and their bound, are the
only ones."""
from __future__ import annotations

import inspect

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url, to_bool
from redis.retry import Retry

_CONNECTION_OPTIONS = inspect.signature(redis.connection.AbstractConnection.__init__).parameters
# A new connection sends no more than it needs before the caller's command: each command of the handshake is one more
# reply to wait for, each up to the socket timeout. So no CLIENT SETINFO (redis-py's default sends two: library name,
# version; newer redis-py takes driver_info=None and warns at lib_name and lib_version, which older ones take) and no
# CLIENT MAINT_NOTIFICATIONS (newer redis-py's default on RESP3, for a managed Redis that moves its endpoints during
# maintenance: our callers' tries reconnect anyway)
LEAN_HANDSHAKE = ({"driver_info": None} if "driver_info" in _CONNECTION_OPTIONS
                  else {"lib_name": None, "lib_version": None})
if "maint_notifications_config" in _CONNECTION_OPTIONS:
    from redis.maint_notifications import MaintNotificationsConfig
    LEAN_HANDSHAKE["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)


def unsupported_options(url: str) -> str | None:
    """Why the Redis URL's query options do not suit this project's clients, or None: they read RESP2 replies of
    bytes (stream entries hold binary fields), and redis-py lets the URL's options override the client's own, so
    protocol=3 or decode_responses=true there would make every read fail. A URL that does not parse (a port that is no
    number) is refused too: a config written for other machines (`serve-config`) met it only when a replica connected."""
    try:
        options = parse_url(url)
    except ValueError as exc:  # redis-py's message names the part, never the password
        return f"it does not parse ({exc})"
    if options.get("protocol") not in (None, 2):
        return (f"its query option protocol={options['protocol']} is not supported: Andromeda's Redis clients read "
                f"RESP2 replies (leave it out, or set protocol=2)")
    if to_bool(options.get("decode_responses")):
        return ("its query option decode_responses is not supported: Andromeda's Redis clients read stream entries "
                "as bytes (leave it out)")
    return None


def redis_client(url: str, wait_s: float) -> redis.Redis:
    """A client of `url` that waits at most `wait_s` for a connection and for each reply, and retries nothing itself
    (said outright: redis-py's default retries differ across its versions and constructors). A command on a new
    connection waits for the connection, for the handshake's replies (HELLO where RESP3, AUTH and SELECT where the URL
    asks for them), then for its own reply: each up to `wait_s`."""
    if why := unsupported_options(url):
        raise ValueError(f"the Redis URL: {why}")
    return redis.Redis.from_url(url, socket_timeout=wait_s, socket_connect_timeout=wait_s, retry=Retry(NoBackoff(), 0),
                                **LEAN_HANDSHAKE)
