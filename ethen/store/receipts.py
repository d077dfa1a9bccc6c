"""Live-certification receipts: store and query dated receipts per provider/model."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, select

from . import schema as s
from ._common import EngineBase, utc
from .engine import boundary
from .errors import StoreInvalidError
from .models import CertificationReceipt
from .values import aware

__all__ = ["Receipts"]


def _receipt(r: Row[Any]) -> CertificationReceipt:
    m = r._mapping
    return CertificationReceipt(
        m["receipt_id"],
        m["provider"],
        m["model"],
        utc(m["certified_at"]) or datetime.now(UTC),
        utc(m["expires_at"]) or datetime.now(UTC),
        dict(m["probe"]),
    )


class Receipts(EngineBase):
    """Live-certification receipts (mixed into :class:`ethen.store.Store`)."""

    async def add_certification(
        self,
        provider: str,
        model: str,
        *,
        certified_at: datetime,
        expires_at: datetime,
        probe: dict[str, Any],
    ) -> CertificationReceipt:
        start, end = aware(certified_at, "certified_at"), aware(expires_at, "expires_at")
        if end <= start:
            raise StoreInvalidError(f"expires_at = {end.isoformat()}: must be after certified_at")
        rid = f"cert_{secrets.token_hex(12)}"
        with boundary("store certification receipt"):
            async with self.writer.begin() as conn:
                await conn.execute(
                    s.certifications.insert().values(
                        receipt_id=rid,
                        provider=provider,
                        model=model,
                        certified_at=start,
                        expires_at=end,
                        probe=probe,
                    )
                )
        return CertificationReceipt(rid, provider, model, start, end, probe)

    async def certifications(self, *, valid_at: datetime | None = None) -> list[CertificationReceipt]:
        """Receipts, newest first; with ``valid_at`` only those valid then."""
        c = s.certifications.c
        q = select(s.certifications).order_by(c.certified_at.desc(), c.receipt_id)
        if valid_at is not None:
            t = aware(valid_at, "valid_at")
            q = q.where(c.certified_at <= t, c.expires_at > t)
        with boundary("read certification receipts"):
            async with self.engine.connect() as conn:
                return [_receipt(r) for r in await conn.execute(q)]
