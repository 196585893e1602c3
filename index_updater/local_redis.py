"""Start a private redis-server on a free loopback port (tests, benchmarks, `andromeda up`)."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import redis

from andromeda_core.errors import AndromedaError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TlsFiles(NamedTuple):
    """PEM files of a TLS-only server: its certificate and key, and the CA that signed the certificate."""

    cert: Path
    key: Path
    ca: Path


class LocalRedis:
    """A redis-server child process; AOF with fsync on every write when `aof` (no acknowledged write is lost)."""

    def __init__(self, directory: str | Path, port: int | None = None, aof: bool = True, extra_args: Sequence[str] = (),
                 username: str | None = None, password: str | None = None, tls: TlsFiles | None = None):
        """`extra_args`: more redis-server options (e.g. --requirepass, --user ACL rules); `username` and
        `password`: what the readiness check authenticates with; `tls`: listen with TLS only (no client
        certificates asked), and `url` is a rediss:// URL that trusts `tls.ca`."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise AndromedaError("redis-server is not installed (apt-get install redis-server), or set REDIS_URL")
        self.directory, self.port, self.aof, self.binary = Path(directory), port or free_port(), aof, binary
        self.extra_args, self.username, self.password, self.tls = list(extra_args), username, password, tls
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None
        self.lock_fd: int | None = None

    def lock(self, wait_s: float = 0.0) -> int:
        """An exclusive lock on the data directory (its file `lock`), for this process and, inherited, the
        redis-server it starts (an orphaned server keeps it): a second server would append to the same AOF files
        as its own, each serving a different data set. OSError naming the directory when it is still held after
        `wait_s`."""
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
            os.close(fd)
            raise OSError(errno.EBUSY, "in use by another redis-server (another `andromeda up` in this folder?); stop "
                                       "it first, or set REDIS_URL", str(self.directory)) from None

    def unlock(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    @property
    def url(self) -> str:
        if self.tls:  # the certificate names localhost, and redis-py checks the name
            return f"rediss://localhost:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={self.tls.ca}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0, lock_wait_s: float = 0.0) -> "LocalRedis":
        listen = (["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert), "--tls-key-file",
                   str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"]
                  if self.tls else ["--port", str(self.port)])
        args = [self.binary, *listen, "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--save", "", "--protected-mode", "yes", "--logfile", str(self.directory / "redis.log")]
        if self.aof:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        self.lock_fd = self.lock(lock_wait_s)
        try:
            # a process group of its own, so that kill() reaches a child it forked (an AOF rewrite, which inherits the
            # directory's lock) too; a terminal's Ctrl-C no longer reaches it: whoever starts it stops it
            self.process = subprocess.Popen(args + self.extra_args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, pass_fds=(self.lock_fd,), start_new_session=True)
            client = redis.Redis.from_url(self.url, username=self.username, password=self.password)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    client.ping()
                    return self
                except (redis.ConnectionError, redis.BusyLoadingError):
                    if time.monotonic() > deadline or self.process.poll() is not None:
                        raise AndromedaError(f"redis-server did not start; see {self.directory / 'redis.log'}") from None
                    time.sleep(0.05)
        except BaseException:  # not started (or interrupted): no server left behind, and the directory free
            self.kill()
            raise

    def restart(self, timeout: float = 10.0) -> "LocalRedis":
        """Start it again, on the same port and data directory (with `aof`, all it acknowledged), after it exited."""
        self.kill()  # reaps the dead server and kills its group (an AOF rewrite child holds the directory's lock too)
        return self.start(timeout, lock_wait_s=5.0)  # a killed child lets go of the lock when it has exited

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crash would, with every process of its group: a server killed during an AOF
        rewrite leaves its rewrite child running, holding the directory's lock."""
        if self.process:
            self._kill_group()
            self.process.wait()
        self.unlock()

    def stop(self) -> None:
        """Shut down (SIGTERM: it ends its rewrite child and fsyncs), then SIGKILL whatever of its group is left."""
        try:
            if self.process and self.process.poll() is None:
                self.process.terminate()
                self.process.wait(timeout=10)
        finally:
            if self.process:
                self._kill_group()
                self.process.wait()
            self.unlock()

    def _kill_group(self) -> None:
        try:  # the group outlives its leader while a member runs; its id is not reused until then
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
