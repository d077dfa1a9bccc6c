"""The request path: the HTTP app and its endpoints (chat, completions, responses, embeddings), the
shared pipeline (auth -> parse -> decide -> admit -> execute -> settle), the executor and its fallback chain,
the stream relay, the request body and SSE helpers, what a request leaves behind (``record``), and the
uvicorn server loop (``serve``)."""

__all__: list[str] = []
