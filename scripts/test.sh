#!/usr/bin/env bash
# Set everything up, then run the whole test suite.
source "$(dirname "$0")/bootstrap.sh"
exec .venv/bin/python -m pytest "$@"
