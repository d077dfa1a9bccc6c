"""What ``ethen up`` prints once it serves (:func:`banner`): the URL, the keys, examples that run as printed,
and, with ``--join``, the command a worker on another machine joins with."""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

__all__ = ["banner"]


def _ethen_command() -> str:
    """How to run ``ethen`` from a shell: the script next to this interpreter (a venv's ``bin``) if any."""
    script = Path(sys.executable).parent / "ethen"
    return shlex.quote(str(script)) if script.is_file() else "ethen"


def banner(url: str, key: str, key_source: str, admin: tuple[str, str] | None, config_path: Path,
           workers: int, join: tuple[str, str, bool] | None = None, second_port: int | None = None) -> str:
    """What ``ethen up`` prints once it serves: the URL, the keys, and examples that run as printed.
    ``join``: (registry address, mesh token file, TLS on) of ``--join``. ``second_port``: a free port for
    the printed ``ethen gateway --config`` command (the config's own port is the one ``ethen up`` holds)."""
    question = '"What is the capital of France?"'
    py = shlex.quote(sys.executable)
    pip = "" if importlib.util.find_spec("openai") else f"{py} -m pip install openai   # the SDK, once\n"
    ethen = _ethen_command()
    data = os.environ.get("ETHEN_DATA_DIR")
    prefix = f"ETHEN_DATA_DIR={shlex.quote(data)} " if data else ""
    root = url.rsplit("/api/", 1)[0]
    if admin is not None:
        admin_text = f"""Admin key ({admin[1]}), for {root}/api/admin/v1 and the dashboard only:
  {admin[0]}
Dashboard: {root}/ui  (sign in with the admin key above)"""
    else:
        admin_text = f"""Admin API: {root}/api/admin/v1 with the admin key of your [store]
Dashboard: {root}/ui  (sign in with the admin key of your [store])"""
    return f"""
Ethen is up: {url}
API key ({key_source}):
  {key}
{admin_text}

curl {url}/chat/completions \\
  -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
  -d '{{"model": "ethen/auto", "temperature": 0, "max_tokens": 32,
       "messages": [{{"role": "user", "content": {question}}}]}}'

{pip}{py} - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{url}", api_key="{key}")
r = client.chat.completions.create(model="ethen/auto", temperature=0, max_tokens=32,
                                   messages=[{{"role": "user", "content": {question}}}])
print(r.choices[0].message.content)
routing = r.model_extra["ethen"]["routing"]  # who served it (any provider), the mesh's nodes if it did
nodes = ((routing.get("mesh") or {{}}).get("route") or {{}}).get("nodes")
print("served by", routing["selected_provider"] + "/" + routing["selected_model"],
      *(["over", nodes] if nodes else []))
PY

Projects, keys, budgets: `ethen projects|keys|usage|certify` act on this gateway's store, no flags needed.
A project key (project 'default', created if missing; accepted here at once):
  {prefix}{ethen} keys create
{_second_text(ethen, config_path, second_port, join is not None)}
{_join_text(ethen, join)}Ctrl-C stops the gateway and the {workers} workers."""


def _second_text(ethen: str, config_path: Path, port: int | None, joined: bool) -> str:
    """The line printing a second gateway on this config (it needs another port than ``ethen up``'s; with
    ``--join`` the config also opens the registry ``ethen up`` holds, so no command is printed)."""
    if joined or port is None:
        return (f"The config it serves: {config_path} (`ethen gateway --config` it once `ethen up` stopped; "
                "its workers stop with it)")
    return (f"A second gateway on these workers, while they run:  {ethen} gateway --config "
            f"{shlex.quote(str(config_path))} --port {port}")


def _join_text(ethen: str, join: tuple[str, str, bool] | None) -> str:
    """The ``--join`` lines: a worker command that runs as printed on this host (another machine's worker also
    binds a reachable ``--host`` with ``--advertise``, ``--tls-cert``/``--tls-key`` and ``--ca-file``: README,
    "Across machines: credentials and membership")."""
    if join is None:
        return ""
    registry, token_file, tls = join
    ca = " --ca-file CA.pem" if tls else ""
    return f"""Workers join the mesh at {registry} (routed within 2 s), e.g. one more worker of layers 20-29:
  {ethen} worker --join {registry} --token-file {shlex.quote(token_file)}{ca} --node-id extra --layers 20-29
"""
