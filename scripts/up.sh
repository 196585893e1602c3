#!/usr/bin/env bash
# Set everything up, then run the main job: the retrieval service on local Ray with a private
# redis-server (unless REDIS_URL is set), a demo corpus and a trained demo model. Ctrl-C stops it.
source "$(dirname "$0")/bootstrap.sh"
exec .venv/bin/andromeda up "$@"
