"""What one ``ethen up`` owns in its data directory (issue 42): the instance lock and the API key of project
``default``.

- **One instance per data directory.** ``ethen up`` holds ``<data dir>/up.lock`` (``flock``, released when
  the process ends, even by ``kill -9``) from before it writes anything until it stops. A second ``ethen up``
  on the same data directory is refused (exit 1, naming the running one's pid and how to start another one:
  ``ETHEN_DATA_DIR=OTHER_DIR``), so it never overwrites the running instance's ``up-gateway.toml``, which
  the commands without flags (``ethen usage``, ``keys``, ``certify``, ``shadows``) and the banner's second
  gateway read. Choice: refuse rather than one config file per instance, so "the config of ``ethen up``"
  stays one file every command finds.
- **The generated key is a project key.** ``ethen up``'s key is a store key (``ethen_<id>_<secret>``) of
  project ``default`` (created if missing, no budget, no restriction), so its requests are settled in the
  ledger and show in ``ethen usage``, the admin API's ``/usage`` and the dashboard under that project. It is
  stored in ``<data dir>/api_key`` (mode 600) and reused while the store knows it; a key the store does not
  know (another database, a revoked key, or the pre-issue-42 key of no project) is replaced by a new one,
  and the banner says so. ``ETHEN_API_KEY`` is used as given: a store key acts for its project, any other
  ``ethen...`` key is a config key of no project.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ethen.paths import data_dir

if TYPE_CHECKING:
    from ethen.store import Store

__all__ = [
    "API_KEY_ENV", "DEFAULT_PROJECT", "InstanceRunning", "UpStateError", "admin_key", "lock_instance",
    "mesh_token_file", "project_key",
]

API_KEY_ENV = "ETHEN_API_KEY"
DEFAULT_PROJECT = "default"
KEY_NAME = "ethen up"
LOCK_FILE = "up.lock"


class UpStateError(Exception):
    """The store of ``ethen up`` failed (unreachable, ...): the message names why."""


class InstanceRunning(Exception):
    """Another ``ethen up`` holds the data directory's lock."""

    def __init__(self, directory: Path, pid: str) -> None:
        self.directory, self.pid = directory, pid
        who = f"pid {pid}" if pid.isdigit() else "another process"
        super().__init__(
            f"another `ethen up` ({who}) runs on the data directory {directory}: it serves "
            f"{directory / 'up-gateway.toml'}, which this one would overwrite. Stop it first (Ctrl-C), or "
            "give this one its own data directory (ETHEN_DATA_DIR=OTHER_DIR ethen up ...)")


def lock_instance(directory: Path) -> int:
    """Take ``directory``'s instance lock (its fd, held until closed or the process ends) and write this
    process's pid in it; :class:`InstanceRunning` when another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise InstanceRunning(directory, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _secret(env_var: str, filename: str, prefix: str) -> tuple[str, str]:
    """(key, where it came from): ``$env_var``, the key stored in the data directory, or a new one stored
    now (mode 600)."""
    from ethen.gateway.accounting.auth import KEY_PREFIX

    env = os.environ.get(env_var)
    if env:
        if not env.startswith(KEY_PREFIX):
            raise typer.BadParameter(f"{env_var} must start with {KEY_PREFIX!r}")
        return env, env_var
    path = data_dir() / filename
    if path.is_file():
        key = path.read_text(encoding="utf-8").strip()
        if key.startswith(KEY_PREFIX):
            return key, str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = f"{prefix}-{secrets.token_urlsafe(32)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(key + "\n")
    return key, f"{path} (generated now)"


def admin_key() -> tuple[str, str]:
    """(admin key, where it came from): ``ETHEN_ADMIN_KEY``, the stored one, or a new one stored now."""
    return _secret("ETHEN_ADMIN_KEY", "admin_key", "ethen-admin")


def mesh_token_file() -> Path:
    """The mesh token of ``ethen up`` (``<data dir>/mesh_token``, mode 600, generated on first run): its
    workers require it on every gRPC call and its gateway config sends it, so another local user cannot drive
    the workers (see :mod:`ethen.mesh.auth`)."""
    path = data_dir() / "mesh_token"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
    return path


def _write_key(path: Path, key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(key + "\n")


async def _project_key(store: Store, env: str | None, path: Path) -> tuple[str, str, bool]:
    from ethen.store import StoreConflictError, StoreNotFoundError, parse_key

    if env:
        principal = await store.authenticate(env) if parse_key(env) is not None else None
        if principal is None:
            return env, f"from {API_KEY_ENV}: a config key, of no project", False
        return env, f"project {principal.project.name!r}, from {API_KEY_ENV}", True
    old = path.read_text(encoding="utf-8").strip() if path.is_file() else ""
    principal = await store.authenticate(old) if parse_key(old) is not None else None
    if principal is not None:
        return old, f"project {principal.project.name!r}, from {path}", True
    try:
        await store.get_project(DEFAULT_PROJECT)
    except StoreNotFoundError:
        with contextlib.suppress(StoreConflictError):  # created meanwhile by another command
            await store.create_project(DEFAULT_PROJECT)
    key, _info = await store.create_key(DEFAULT_PROJECT, name=KEY_NAME)
    _write_key(path, key)
    replaced = "; it replaces the previous one, which this store does not know" if old else ""
    return key, f"project {DEFAULT_PROJECT!r}, generated now into {path}{replaced}", True


def project_key(store_url: str, path: Path) -> tuple[str, str, bool]:
    """``ethen up``'s API key in the store at ``store_url``: (key, where it came from, whether it is a store
    key). See the module: ``$ETHEN_API_KEY``, else the key in ``path`` while the store knows it, else a new
    key of project ``default`` written to ``path`` (mode 600). Raises :class:`UpStateError` (the store is
    unreachable, ...)."""

    from ethen.store import Store, StoreError

    async def run() -> tuple[str, str, bool]:
        store = await Store.open(store_url)
        try:
            return await _project_key(store, os.environ.get(API_KEY_ENV) or None, path)
        finally:
            await store.aclose()

    try:
        return asyncio.run(run())
    except StoreError as exc:
        raise UpStateError(exc.message) from None
