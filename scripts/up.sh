#!/usr/bin/env bash
# Set everything up, then run the main job (for now: the offline retrieval demo on CPU).
source "$(dirname "$0")/bootstrap.sh"
exec .venv/bin/andromeda demo "$@"
