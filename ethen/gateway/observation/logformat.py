"""Log output of ``ethen gateway`` and ``ethen up``: ``--log-format text`` (the default) or ``json``.

``json`` writes one JSON object per line on stderr: ``time`` (ISO-8601 UTC, milliseconds), ``level``,
``logger``, ``message`` (formatted), every ``extra`` field the call passed (values JSON cannot hold are
``str()``-ed), and ``exception`` when there is one. uvicorn's own loggers (start-up, errors, the debug access
log) get the same formatter: their handlers come from ``uvicorn.config.LOGGING_CONFIG``, which this module
points at :class:`JsonFormatter` before the server is built.

The choice is also put in ``$ETHEN_LOG_FORMAT``, so the processes ``ethen gateway --workers N`` starts log the
same way. Nothing logged carries a secret: the gateway logs request ids, candidates and error codes, never a
message body or a key (``tests/gateway/observation/test_service_logformat.py`` scans every record for them).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from typing import Any

from uvicorn.config import LOGGING_CONFIG  # the dict uvicorn.Config applies by default

__all__ = ["FORMATS", "LOG_FORMAT_ENV", "JsonFormatter", "configure_logging"]

FORMATS = ("text", "json")
LOG_FORMAT_ENV = "ETHEN_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: attributes every LogRecord has (anything else on a record came in through ``extra=``)
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "color_message", "taskName",
}


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()  # uvicorn's dictConfig passes fmt/use_colors: not used here

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and not k.startswith("_") and k not in out:
                out[k] = _jsonable(v)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, fmt: str) -> None:
    """The root handler on stderr at ``level`` in ``fmt`` (``text`` or ``json``; checked by the caller)."""
    os.environ[LOG_FORMAT_ENV] = fmt  # --workers children inherit it
    if fmt != "json":
        logging.basicConfig(level=level, format=TEXT_FORMAT)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for name in ("default", "access"):
        LOGGING_CONFIG["formatters"][name] = {"()": "ethen.gateway.observation.logformat.JsonFormatter"}
