"""Where Ethen keeps its local files: the data directory and the paths ``ethen up`` derives from it.

A leaf module (imports nothing of ``ethen``), so ``ethen up``, the admin CLI and the dashboard sessions agree
on one directory without importing each other. The data directory is ``$ETHEN_DATA_DIR``, else
``$XDG_DATA_HOME/ethen``, else ``~/.local/share/ethen``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["data_dir", "default_store_url", "up_config_path"]


def data_dir() -> Path:
    env = os.environ.get("ETHEN_DATA_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "ethen"


def default_store_url() -> str:
    """The embedded store of ``ethen up``: SQLite in the data directory."""
    return f"sqlite:///{(data_dir() / 'ethen.db').resolve()}"


def up_config_path() -> Path:
    """Where ``ethen up`` writes the gateway config it serves."""
    return data_dir() / "up-gateway.toml"
