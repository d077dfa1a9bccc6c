"""What one ``ethen up`` owns in its data directory (issue 42, items 3 and 5; :mod:`ethen.up_state`), on a
real SQLite store and real ``flock`` locks: the API key is a key of project ``default`` (made once, reused
while the store knows it, replacing a key the store does not know), ``ETHEN_API_KEY`` is used as given, and a
second instance lock on a data directory is refused while the first is held, by another process or this
one."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ethen.store import Store
from ethen.up_state import InstanceRunning, UpStateError, lock_instance, project_key


def _keys(url: str) -> list[tuple[str, str]]:
    async def run() -> list[tuple[str, str]]:
        store = await Store.open(url)
        try:
            return [(k.key_id, k.project) for k in await store.list_keys()]
        finally:
            await store.aclose()

    return asyncio.run(run())


def test_the_generated_key_is_a_key_of_project_default_reused_while_the_store_knows_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETHEN_API_KEY", raising=False)
    url, path = f"sqlite:///{tmp_path / 'ethen.db'}", tmp_path / "api_key"
    key, source, in_store = project_key(url, path)
    assert in_store and key.startswith("ethen_") and source.startswith("project 'default', generated now")
    assert path.read_text().strip() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _keys(url) == [(key.split("_")[1], "default")]
    again = project_key(url, path)
    assert again == (key, f"project 'default', from {path}", True)  # reused: no second key
    assert len(_keys(url)) == 1
    other = f"sqlite:///{tmp_path / 'other.db'}"  # another store does not know it: a new key replaces it
    new, source, _ = project_key(other, path)
    assert new != key and "it replaces the previous one" in source
    assert path.read_text().strip() == new


def test_a_key_of_no_project_in_the_file_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETHEN_API_KEY", raising=False)
    path = tmp_path / "api_key"
    path.write_text("ethen-the-key-ethen-up-made-before-issue-42\n")
    key, source, in_store = project_key(f"sqlite:///{tmp_path / 'ethen.db'}", path)
    assert in_store and key.startswith("ethen_") and "it replaces the previous one" in source


def test_ethen_api_key_is_used_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'ethen.db'}"
    monkeypatch.delenv("ETHEN_API_KEY", raising=False)
    store_key, _, _ = project_key(url, tmp_path / "api_key")
    monkeypatch.setenv("ETHEN_API_KEY", store_key)
    assert project_key(url, tmp_path / "unused") == (store_key, "project 'default', from ETHEN_API_KEY", True)
    monkeypatch.setenv("ETHEN_API_KEY", "ethen-a-config-key-0123456789")
    key, source, in_store = project_key(url, tmp_path / "unused")
    assert (key, in_store) == ("ethen-a-config-key-0123456789", False) and "of no project" in source
    assert not (tmp_path / "unused").exists()


def test_an_unreachable_store_is_an_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETHEN_API_KEY", raising=False)
    with pytest.raises(UpStateError):
        project_key(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'ethen.db'}", tmp_path / "api_key")
    assert not (tmp_path / "api_key").exists()


_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ethen.up_state import lock_instance
    lock_instance(Path(sys.argv[1]))
    print("locked", flush=True)
    time.sleep(600)
""")


def test_one_instance_lock_per_data_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(data)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(InstanceRunning, match=f"pid {holder.pid}"):
            lock_instance(data)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    fd = lock_instance(data)  # the holder died (SIGKILL): the kernel released its lock
    try:
        assert (data / "up.lock").read_text().strip() == str(os.getpid())
        with pytest.raises(InstanceRunning, match=f"pid {os.getpid()}"):
            lock_instance(data)  # even from this process: the lock is per open file
    finally:
        os.close(fd)
    os.close(lock_instance(data))  # released by close
