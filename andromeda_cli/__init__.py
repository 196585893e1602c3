"""The `andromeda` command: the outermost layer. It starts services and publishes events, so it may
import every package (kernels, andromeda_core, index_updater, deployments); nothing imports it.

- main: argument parsing and the offline commands (schema, synth, retrieve, demo, train, eval, publish);
  every error the user can act on ends in one line `error: ...` and exit status 2.
- args: argparse types (bounded integers, input files, output directories).
- request_file: `retrieve`'s request files, checked in full before the index is built.
- service: `andromeda serve`, `andromeda up` and `andromeda serve-config` (Ray Serve, Redis).
"""
