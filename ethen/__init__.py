"""Ethen: an open LLM routing layer.

Two levels of routing live in this one package:

* ``ethen.gateway`` - the OpenAI-compatible gateway that smart-routes ``ethen/*`` aliases
  (spec: ``gateway-smart-routing.md``).
* ``ethen.mesh`` - cost-aware routing of a model's layers over worker nodes
  (spec: ``mesh-cost-aware-routing.es.md``).

Each sub-package keeps a pure, deterministic routing core (no I/O, no clock, no randomness)
and a thin imperative shell around it (HTTP, gRPC, CLI).
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
