"""The README's keys example acts on the store ``ethen up`` serves (issue 23 item 10): run as printed, with
no ``ETHEN_DATABASE_URL``, its ``keys create`` lands in ``<data dir>/ethen.db``, not in a second database."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

from ethen.store import Store

ROOT = Path(__file__).resolve().parents[1]


def _keys_example() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Projects, keys, budgets", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block in the README's keys section"
    lines = block.group(1).splitlines()
    end = next(i for i, ln in enumerate(lines) if "keys create" in ln)
    return "\n".join(lines[:end + 1]) + "\n"


def test_the_readme_keys_example_uses_ethen_ups_store(tmp_path: Path) -> None:
    data, cwd = tmp_path / "data", tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "ETHEN_DATA_DIR": str(data)}
    for var in ("ETHEN_DATABASE_URL", "ETHEN_API_KEY", "ETHEN_ADMIN_KEY"):
        env.pop(var, None)
    script = _keys_example().replace(".venv/bin/ethen", str(ROOT / ".venv" / "bin" / "ethen"))
    out = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd=cwd)
    assert out.returncode == 0, out.stderr
    assert list(cwd.iterdir()) == []  # no second database next to the shell

    async def keys() -> int:
        store = await Store.open(f"sqlite:///{data / 'ethen.db'}")
        try:
            return len(await store.list_keys("default"))
        finally:
            await store.aclose()

    assert asyncio.run(keys()) == 1
