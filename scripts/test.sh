#!/usr/bin/env bash
# Set everything up, then run the whole test suite.
source "$(dirname "$0")/bootstrap.sh"
if ! command -v redis-server >/dev/null; then  # with REDIS_URL set too: the tests that kill or hang one start their own
  apt_install redis-server
fi
if ! command -v openssl >/dev/null; then  # the Redis TLS tests make their certificates with it
  apt_install openssl
fi
exec .venv/bin/python -m pytest "$@"
