"""A private PostgreSQL cluster for the fleet tests: initdb + pg_ctl in a temporary directory,
listening on 127.0.0.1 on a free port (and a Unix socket inside its own directory), trust
authentication for loopback only, stopped (pg_ctl stop -m immediate) however the tests end.

PostgreSQL refuses to run as root, so under root (CI and the dev machines run as root) the cluster
runs as the `postgres` system user the Debian package creates, in a directory that user owns.
Missing binaries (or psycopg2) skip the tests, unless MOESPEC_REQUIRE_BACKENDS=1 makes it a failure,
exactly as for Prometheus and Phoenix (tests/real_backends.py).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.real_backends import free_port, missing, wait_until

SYSTEM_USER = "postgres"  # who runs the cluster when the tests run as root
PG_DIRS = ("/usr/lib/postgresql",)


def pg_bin(name: str) -> str:
    """`initdb` / `pg_ctl` from PATH, else the newest /usr/lib/postgresql/<version>/bin."""
    found = shutil.which(name)
    if found:
        return found
    for root in PG_DIRS:
        versions = sorted(Path(root).glob("*/bin"), key=lambda p: p.parent.name, reverse=True) \
            if Path(root).is_dir() else []
        for bin_dir in versions:
            if (bin_dir / name).exists():
                return str(bin_dir / name)
    missing("PostgreSQL", "apt-get install postgresql; scripts/setup_venv.sh test does it")
    raise AssertionError("unreachable")  # missing() skips or fails


@dataclass
class Postgres:
    data: Path
    port: int
    pg_ctl: str
    run_as: dict  # subprocess user/group keyword arguments

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://moespec@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A fresh, empty database -> its SQLAlchemy URL (each test gets its own)."""
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="moespec", dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.url(name)

    def stop(self) -> None:
        subprocess.run([self.pg_ctl, "stop", "-D", str(self.data), "-m", "immediate", "-w"],
                       capture_output=True, timeout=60, **self.run_as)
        shutil.rmtree(self.data.parent, ignore_errors=True)


def start_postgres() -> Postgres:
    try:
        import psycopg2  # noqa: F401  (the driver the storage URL names)
    except ImportError:
        missing("psycopg2", "pip install psycopg2-binary; the test extra has it")
    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    root = Path(tempfile.mkdtemp(prefix="moespec-pg-"))
    run_as: dict = {}
    if os.geteuid() == 0:
        user = pwd.getpwnam(SYSTEM_USER)
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    data = root / "data"
    init = subprocess.run([initdb, "-D", str(data), "-U", "moespec", "--auth=trust", "-E", "UTF8", "--no-sync"],
                          capture_output=True, text=True, timeout=120, **run_as)
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"initdb failed:\n{init.stdout}\n{init.stderr}")
    port = free_port()
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=100"
    started = subprocess.run([pg_ctl, "start", "-D", str(data), "-l", str(root / "postgres.log"), "-o", options,
                              "-w", "-t", "60"], capture_output=True, text=True, timeout=90, **run_as)
    pg = Postgres(data, port, pg_ctl, run_as)
    if started.returncode != 0:
        log = (root / "postgres.log").read_text(errors="replace")[-3000:] if (root / "postgres.log").exists() else ""
        pg.stop()
        raise RuntimeError(f"pg_ctl start failed:\n{started.stdout}\n{started.stderr}\n{log}")

    def accepts() -> bool:
        import psycopg2

        psycopg2.connect(host="127.0.0.1", port=port, user="moespec", dbname="postgres").close()
        return True

    wait_until(accepts, 30, what="PostgreSQL accepting connections")
    return pg
