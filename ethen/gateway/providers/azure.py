"""Azure OpenAI (``kind = "azure_openai"``): the OpenAI wire format at deployment URLs,
``POST {endpoint}/openai/deployments/{deployment}/chat/completions?api-version={api_version}``, the key in
the ``api-key`` header. The route's upstream model is the deployment name (as LiteLLM's
``azure/<deployment>``).

Azure's content filter: a prompt it refuses is a 400 whose ``error.code`` is ``content_filter`` (its
``innererror.content_filter_result`` names the categories); it becomes
:class:`~ethen.gateway.errors.UpstreamContentFilterError` (400, code ``content_filter``, not retried on
another candidate), naming the filtered categories. A completion the filter cut keeps OpenAI's
``finish_reason: "content_filter"``. Embeddings: ``{endpoint}/openai/deployments/{deployment}/embeddings``.
Everything else is the OpenAI-compatible provider's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from ethen.gateway.errors import UpstreamContentFilterError, UpstreamError
from ethen.gateway.providers.http import redact, upstream_message
from ethen.gateway.providers.openai_compat import OpenAICompatProvider

__all__ = ["AzureOpenAIProvider", "content_filter_error"]


def _filtered(result: Any) -> list[str]:
    if not isinstance(result, Mapping):
        return []
    return sorted(str(k) for k, v in result.items() if isinstance(v, Mapping) and v.get("filtered"))


def content_filter_error(provider: str, status: int, content: bytes, secret: str | None
                         ) -> UpstreamContentFilterError | None:
    """The gateway error for Azure's content-filter refusal, or ``None`` for any other error body."""
    try:
        obj = json.loads(content)
    except ValueError:
        return None
    err = obj.get("error") if isinstance(obj, Mapping) else None
    if not isinstance(err, Mapping):
        return None
    inner = err.get("innererror")
    inner_code = inner.get("code") if isinstance(inner, Mapping) else None
    if err.get("code") != "content_filter" and inner_code != "ResponsibleAIPolicyViolation":
        return None
    cats = _filtered(inner.get("content_filter_result") if isinstance(inner, Mapping) else None)
    what = f" (filtered: {', '.join(cats)})" if cats else ""
    detail = upstream_message(redact(content, secret))
    return UpstreamContentFilterError(
        f"provider {provider!r}: Azure's content filter refused the prompt{what}: {detail}", provider, status)


class AzureOpenAIProvider(OpenAICompatProvider):
    """Azure OpenAI deployments: ``base_url`` is the resource endpoint (``https://<name>.openai.azure.com``)."""

    takes_prompt_cache_key = False

    def __init__(self, name: str, base_url: str, api_key: str | None = None, *, api_version: str,
                 **kw: Any) -> None:
        self.api_version = api_version
        super().__init__(name, base_url, api_key, **kw)

    def credential_headers(self, api_key: str) -> dict[str, str]:
        return {"api-key": api_key}

    def _deployment(self, upstream_model: str, op: str) -> str:
        return (f"openai/deployments/{quote(upstream_model, safe='-._~')}/{op}"
                f"?api-version={quote(self.api_version, safe='-._~')}")

    def chat_path(self, upstream_model: str) -> str:
        return self._deployment(upstream_model, "chat/completions")

    def embeddings_path(self, upstream_model: str) -> str:
        return self._deployment(upstream_model, "embeddings")

    def error(self, status: int, content: bytes) -> UpstreamError:
        filtered = content_filter_error(self.name, status, content, self._secret)
        return filtered if filtered is not None else super().error(status, content)
