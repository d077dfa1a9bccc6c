"""The admin surfaces of the gateway: the admin HTTP API (``/api/admin/v1``: projects, keys, usage, request
log, certifications) and the ``ethen keys / projects / usage / logs / certify`` commands. The request path's
accounts (keys, project policy, budget admission and settlement) live in
:mod:`ethen.gateway.accounting.accounts`."""

__all__: list[str] = []
