"""The `andromeda` command: the outermost layer. It starts services and publishes events, so it may
import every package (kernels, andromeda_core, index_updater, deployments); nothing imports it.

- main: argument parsing and the offline commands (schema, synth, retrieve, demo, train, eval, publish).
- service: `andromeda serve`, `andromeda up` and `andromeda serve-config` (Ray Serve, Redis).
"""
