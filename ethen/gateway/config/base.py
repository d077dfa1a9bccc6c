"""What every config section model shares: strict pydantic models (unknown keys, wrong types and mutation
refused), the id pattern of providers and workers, and the int-to-float coercion of numeric keys. Private to
the package: the section modules import these names; nothing here is public API."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StringConstraints

__all__: list[str] = []

_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _float(v: Any) -> Any:
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


_NonEmpty = Annotated[str, StringConstraints(min_length=1)]
