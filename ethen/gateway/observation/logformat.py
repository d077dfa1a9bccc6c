"""Log output of ``ethen gateway`` and ``ethen up``: ``--log-format text`` (the default) or ``json``.

``json`` writes one JSON object per line on stderr: ``time`` (ISO-8601 UTC, milliseconds), ``level``,
``logger``, ``message`` (formatted), every ``extra`` field the call passed (values JSON cannot hold are
``str()``-ed), and ``exception`` when there is one. uvicorn's own loggers (start-up, errors, the debug access
log) get the same formatter: their handlers come from ``uvicorn.config.LOGGING_CONFIG``, which this module
points at :class:`JsonFormatter` before the server is built.

The choice is also put in ``$ETHEN_LOG_FORMAT``, so the processes ``ethen gateway --workers N`` starts log the
same way. Nothing logged carries a secret: the gateway logs request ids, candidates and error codes, never a
message body or a key (``tests/gateway/observation/test_service_logformat.py`` scans every record for them).

Query-string secrets (issue 42: ``?api_key=...`` was written verbatim by uvicorn's debug access log): every
record, whatever its logger, has the value of each query parameter whose name looks like a secret (it
contains ``key``, ``token``, ``secret``, ``passw``, ``auth``, ``signature``, ``session`` or ``credential``:
``api_key``, ``key``, ``access_token``, ``X-Amz-Signature``...) replaced by ``[REDACTED]`` in its message,
its string arguments and its traceback text (:func:`redact_query`). It is done where records are made (a
``logging`` record factory installed by :func:`install_redaction`, from :func:`configure_logging` and from
:func:`ethen.gateway.api.serve.serve`), so no handler or formatter, uvicorn's included, sees the secret.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from uvicorn.config import LOGGING_CONFIG  # the dict uvicorn.Config applies by default

__all__ = ["FORMATS", "LOG_FORMAT_ENV", "REDACTED", "JsonFormatter", "configure_logging", "install_redaction",
           "redact_query"]

FORMATS = ("text", "json")
LOG_FORMAT_ENV = "ETHEN_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: attributes every LogRecord has (anything else on a record came in through ``extra=``)
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "color_message", "taskName",
}


REDACTED = "[REDACTED]"
_SECRET_PARAM = re.compile(
    r"([?&;][^=&;?#\s\"'<>]*?(?:key|token|secret|passw|auth|signature|session|credential)[^=&;?#\s\"'<>]*=)"
    r"[^&;#\s\"'<>]*", re.IGNORECASE)


def redact_query(text: str) -> str:
    """``text`` with the value of every secret-looking query parameter replaced (module docstring)."""
    if "=" not in text:
        return text
    return _SECRET_PARAM.sub(lambda m: m.group(1) + REDACTED, text)


def _clean(v: Any) -> Any:
    return redact_query(v) if isinstance(v, str) else v


_PLAIN = logging.Formatter()


def _redacting(base: Callable[..., logging.LogRecord]) -> Callable[..., logging.LogRecord]:
    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = base(*args, **kwargs)
        if isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        a = record.args
        if isinstance(a, tuple):
            record.args = tuple(_clean(x) for x in a)
        elif isinstance(a, Mapping):
            record.args = {k: _clean(x) for k, x in a.items()}
        if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
            record.exc_text = redact_query(_PLAIN.formatException(record.exc_info))
        return record

    make.ethen_redacting = True  # type: ignore[attr-defined]
    return make


def install_redaction() -> None:
    """Redact query secrets in every log record made from now on (module docstring); idempotent."""
    current = logging.getLogRecordFactory()
    if not getattr(current, "ethen_redacting", False):
        logging.setLogRecordFactory(_redacting(current))


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
                out[k] = _jsonable(_clean(v))  # extras are set after the record factory ran
        if record.exc_info:
            out["exception"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, fmt: str) -> None:
    """The root handler on stderr at ``level`` in ``fmt`` (``text`` or ``json``; checked by the caller)."""
    os.environ[LOG_FORMAT_ENV] = fmt  # --workers children inherit it
    install_redaction()
    if fmt != "json":
        logging.basicConfig(level=level, format=TEXT_FORMAT)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for name in ("default", "access"):
        LOGGING_CONFIG["formatters"][name] = {"()": "ethen.gateway.observation.logformat.JsonFormatter"}
