"""A throwaway MariaDB server for tests and benchmarks: its own data directory, 127.0.0.1 only,
utf8mb4 (without --character-set-server MariaDB makes latin1 tables), a `sage` user whose
password is in a file beside the data (so the store spec holds no password).

`MariaDB(directory).start()` installs the data directory the first time, starts `mariadbd`,
waits until it answers, and makes the user; `stop()` sends SIGTERM, then SIGKILL; `crash()` is
kill -9 (the data directory survives; `start()` again recovers it). `store(database)` is the
`mysql://` spec of a database on it, which `sage-tfx ledger init` creates.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional

import portpicker

USER = "sage"
_READY_SECONDS = 60


def missing_reason() -> Optional[str]:
    """Why a MariaDB server cannot be started here (None if it can)."""
    for program in ("mariadbd", "mariadb-install-db"):
        if not _which(program):
            return (f"{program} is not installed (`make mariadb` installs Debian's "
                    "mariadb-server when run as root)")
    return None


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM it when the process that started it dies
    (a test run that aborts must not leave servers behind). Linux's PR_SET_PDEATHSIG."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _which(program: str) -> Optional[str]:
    return shutil.which(program) or shutil.which(program, path="/usr/sbin:/usr/bin")


class MariaDB:
    def __init__(self, directory: os.PathLike):
        self.directory = Path(directory)
        self.data = self.directory / "data"
        self.socket = str(self.directory / "mysqld.sock")
        self.password_file = self.directory / "password"
        self.port: Optional[int] = None
        self.process: Optional[subprocess.Popen] = None
        self._databases = itertools.count()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> "MariaDB":
        first = not self.data.exists()
        if first:
            self.directory.mkdir(parents=True, exist_ok=True)
            subprocess.run([_which("mariadb-install-db"), "--no-defaults",
                            "--auth-root-authentication-method=normal",
                            f"--datadir={self.data}", *self._as_root()],
                           check=True, capture_output=True)
        self.port = self.port or portpicker.pick_unused_port()
        with open(self.directory / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                [_which("mariadbd"), "--no-defaults", *self._as_root(), f"--datadir={self.data}",
                 f"--socket={self.socket}", f"--port={self.port}", "--bind-address=127.0.0.1",
                 "--character-set-server=utf8mb4", "--collation-server=utf8mb4_bin",
                 f"--log-error={self.directory / 'error.log'}", "--skip-name-resolve",
                 "--max-connections=500"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self._wait_ready()
        if first:
            self._make_user()
        return self

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def crash(self) -> None:
        """kill -9: no shutdown, InnoDB recovers from its log on the next start."""
        self.process.kill()
        self.process.wait()
        self.process = None

    # ----------------------------------------------------------------- stores
    def store(self, database: Optional[str] = None) -> str:
        """A `mysql://` spec of `database` (default: a new name) on this server."""
        database = database or f"ledger{next(self._databases)}"
        return (f"mysql://{USER}@127.0.0.1:{self.port}/{database}"
                f"?password_file={self.password_file}")

    def socket_store(self, database: str) -> str:
        return (f"mysql://{USER}@localhost/{database}?socket={self.socket}"
                f"&password_file={self.password_file}")

    @contextlib.contextmanager
    def round_trips(self) -> Iterator[list]:
        """Counts the queries clients send the server inside the block, each a round trip (a
        batch of statements sent together is one), from the server's general log: the list it
        yields holds the count once the block ends. Nothing else may use the server meanwhile."""
        import pymysql

        counted = []
        # One connection switches the log on and off and counts: its own queries are not
        # counted.
        connection = pymysql.connect(unix_socket=self.socket, user="root", autocommit=True)
        try:
            with connection.cursor() as cursor:
                for statement in ("SET GLOBAL log_output = 'TABLE'",
                                  "TRUNCATE TABLE mysql.general_log", "SET GLOBAL general_log = 1"):
                    cursor.execute(statement)
                try:
                    yield counted
                finally:
                    cursor.execute("SET GLOBAL general_log = 0")
                    cursor.execute("SELECT COUNT(*) FROM mysql.general_log WHERE command_type = "
                                   "'Query' AND thread_id <> CONNECTION_ID()")
                    counted.append(cursor.fetchone()[0])
        finally:
            connection.close()

    def execute(self, *statements: str) -> list:
        """Run SQL as root over the socket; the rows of the last statement."""
        import pymysql

        connection = pymysql.connect(unix_socket=self.socket, user="root", charset="utf8mb4")
        try:
            with connection.cursor() as cursor:
                for statement in statements:
                    cursor.execute(statement)
                connection.commit()
                return list(cursor.fetchall())
        finally:
            connection.close()

    # ----------------------------------------------------------------- internals
    @staticmethod
    def _as_root() -> list[str]:
        return ["--user=root"] if os.getuid() == 0 else []

    def _wait_ready(self) -> None:
        import pymysql

        deadline = time.monotonic() + _READY_SECONDS
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"mariadbd exited with {self.process.returncode}; see "
                                   f"{self.directory / 'error.log'}")
            try:
                pymysql.connect(unix_socket=self.socket, user="root", connect_timeout=1).close()
                return
            except pymysql.MySQLError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _make_user(self) -> None:
        password = os.urandom(12).hex()
        self.password_file.write_text(password + "\n")
        # The install's anonymous ''@localhost would match a TCP login from 127.0.0.1 before
        # 'sage'@'%' does (MySQL picks the most specific host), and refuse it.
        self.execute("DELETE FROM mysql.global_priv WHERE User = ''", "FLUSH PRIVILEGES",
                     f"CREATE USER '{USER}'@'%' IDENTIFIED BY '{password}'",
                     f"GRANT ALL ON *.* TO '{USER}'@'%'")
