"""Observation: the request log (memory ring or store), Prometheus metrics, OpenTelemetry traces, the
telemetry store routing reads (latency, TTFT, success per candidate) and the log format."""

__all__: list[str] = []
