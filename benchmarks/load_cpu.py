"""CPU accounting for the load benchmark, from /proc: CPU seconds of this process's descendants by
role (Ray's process titles name the deployment), of this process with them, and of the whole machine,
so that work by other processes during a step shows up."""
from __future__ import annotations

import os
from pathlib import Path

GENERATOR = "load generator"
ROLES = ((GENERATOR, "multiprocessing"), ("FAISS server", "benchmarks.load_faiss"),
         ("Serve proxy", "ProxyActor"), ("router", ":router"), ("shards", ":shard-"), ("redis-server", "redis-server"))
RAY_OTHER = "Ray (controller, GCS, raylet, agents)"
OURS, MACHINE = "ours", "machine"
TICK = os.sysconf("SC_CLK_TCK")


def role(cmdline: str) -> str:
    return next((name for name, pattern in ROLES if pattern in cmdline), RAY_OTHER)


def processes() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds so far, command line) of every process still running."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # exited meanwhile
                continue
            out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, cmdline)
    return out


def snapshot() -> dict[str, float]:
    """CPU seconds so far per role of this process's descendants, of them with this process (OURS) and
    of the machine (MACHINE, all cores)."""
    procs = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    totals = {OURS: procs[os.getpid()][1], MACHINE: machine_busy()}
    todo = list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        _, cpu, cmdline = procs[pid]
        totals[role(cmdline)] = totals.get(role(cmdline), 0.0) + cpu
        totals[OURS] += cpu
    return totals


def machine_busy() -> float:
    """CPU seconds all cores spent not idle since boot (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK


def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent between two snapshots, per key."""
    return {key: after[key] - before.get(key, 0.0) for key in after}


def costs(spent: dict[str, float], answered: int, wall_s: float) -> dict:
    """One step's CPU: ms per answered request by role (cpu_ms), of the server (server_cpu_ms: every role
    but the load generator) and the other processes' CPU in cores (others_cores)."""
    per = {r: 1000 * t / max(answered, 1) for r, t in spent.items() if r not in (OURS, MACHINE)}
    return {"cpu_ms": per, "server_cpu_ms": sum(t for r, t in per.items() if r != GENERATOR),
            "others_cores": (spent[MACHINE] - spent[OURS]) / wall_s}
