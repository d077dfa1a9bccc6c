"""The request log in the store (issue 14): one row per finished gateway request, written in batches by the
gateway's log writer (:mod:`ethen.gateway.observation.requestlog`), off the request path; this package only
knows the tables. Its modules: :mod:`.table` (the tables and their migrations), :mod:`.encode` (a row
encoded once for the database), :mod:`.writes` (batch inserts and retention) and :mod:`.queries` (listings,
one request, the count, the admin API's view of a row); each row's cost and cache savings are stored as
nano-USD and shown as ``cost_usd`` / ``saved_usd``."""

from __future__ import annotations

from .encode import *  # noqa: F403
from .encode import __all__ as _encode_all
from .queries import *  # noqa: F403
from .queries import __all__ as _queries_all
from .table import *  # noqa: F403
from .table import __all__ as _table_all
from .writes import *  # noqa: F403
from .writes import __all__ as _writes_all

__all__ = [*_table_all, *_encode_all, *_writes_all, *_queries_all]
