"""A real PgBouncer (the distribution's ``pgbouncer``) in transaction mode in front of the test
PostgreSQL server, for as long as a test needs it.

It listens on a free loopback port with trust authentication and forwards every database name to
``127.0.0.1:5432``, so a URL from ``tests.helpers.postgres`` reaches the same database through it
once its port is swapped (:func:`through`). PgBouncer refuses to run as root: as root it runs as
the ``postgres`` user, its files in a directory that user owns. Missing, it skips the test, or
fails it under ``AUTOBATCH_TEST_PGBOUNCER=required`` (``.ci/run`` sets it and installs it).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

ENV_VAR = "AUTOBATCH_TEST_PGBOUNCER"
SERVER = "127.0.0.1:5432"


def _missing(reason: str) -> NoReturn:
    message = f"{reason} (apt-get install pgbouncer; {ENV_VAR}=required makes this a failure)"
    if os.environ.get(ENV_VAR) == "required":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _postgres_user() -> pwd.struct_passwd:
    """The ``postgres`` user PgBouncer runs as when the tests run as root (it refuses root)."""
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        _missing("no 'postgres' user for pgbouncer to run as (it refuses to run as root)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _config(folder: Path, port: int, extra: str) -> Path:
    (folder / "userlist.txt").write_text('"postgres" ""\n')
    ini = folder / "pgbouncer.ini"
    ini.write_text(
        "[databases]\n"
        f"* = host={SERVER.split(':')[0]} port={SERVER.split(':')[1]}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {folder / 'userlist.txt'}\n"
        "pool_mode = transaction\n"
        "max_client_conn = 200\n"
        "default_pool_size = 20\n"
        f"logfile = {folder / 'pgbouncer.log'}\n"
        f"{extra}"
    )
    return ini


@contextlib.contextmanager
def pgbouncer(*, extra: str = "") -> Iterator[int]:
    """Run PgBouncer in transaction mode; yield its port. ``extra``: more ``[pgbouncer]``
    settings, one per line."""
    binary = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None
    )
    if binary is None:
        _missing("pgbouncer is not installed")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="pgbouncer-") as name:
        folder = Path(name)
        command = [binary, str(_config(folder, port, extra))]
        if os.geteuid() == 0:  # it will not run as root
            user = _postgres_user()
            for path in (folder, *folder.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            command = ["runuser", "-u", "postgres", "--", *command]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 20
            while True:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), timeout=1),
                ):
                    break
                if process.poll() is not None or time.monotonic() > deadline:
                    log = folder / "pgbouncer.log"
                    output = process.stdout.read().decode() if process.stdout else ""
                    text = log.read_text() if log.exists() else ""
                    pytest.fail(f"pgbouncer did not start: {output} {text}", pytrace=False)
                time.sleep(0.1)
            yield port
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


def through(url: str, port: int) -> str:
    """``url`` (a database on the test server) reached through PgBouncer on ``port``."""
    assert SERVER in url, url
    return url.replace(SERVER, f"127.0.0.1:{port}")
