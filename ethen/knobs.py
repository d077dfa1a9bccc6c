"""The environment variables of the model engine's choice, read by the command-line entry points only.

A user chooses the engine with three flags of ``ethen worker`` and ``ethen up``: ``--engine
auto|ggml|onnx``, ``--accuracy auto|exact|fast``, ``--device auto|cpu|cuda|metal|vulkan``
(:class:`ethen.model.choose.EngineOptions`, passed down as a parameter: nothing under ``ethen.model`` or
``ethen.mesh`` reads the environment for them). ``$ETHEN_ENGINE`` (:data:`ENGINE_ENV`) is the default of
``--engine``; the variables of :data:`GONE_ENV` are no longer read: :func:`warn_gone_env` says so, once
(``ethen worker``, ``ethen up``, ``ethen gateway``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENGINE_ENV", "GONE_ENV", "warn_gone_env"]

#: the default of ``--engine`` (``ethen worker``, ``ethen up``): the one engine variable left
ENGINE_ENV = "ETHEN_ENGINE"
#: variables that used to choose the engine or its cache, now ignored -> what to use instead
GONE_ENV = {"ETHEN_ACCURACY": "--accuracy (ethen worker, ethen up; a mesh provider's accuracy key)",
            "ETHEN_DEVICE": "--device (ethen worker, ethen up; a mesh provider's device key)",
            "ETHEN_CACHE_DIR": "XDG_CACHE_HOME (the cache is $XDG_CACHE_HOME/ethen)"}


def warn_gone_env() -> list[str]:
    """One stderr line per variable of :data:`GONE_ENV` that is set (ignored: the flags decide), dropped
    from this process's environment so the workers it starts do not repeat the warning; the variables."""
    gone = [var for var in GONE_ENV if var in os.environ]
    for var in gone:
        del os.environ[var]
        print(f"warning: {var} is no longer read (ignored); use {GONE_ENV[var]}", file=sys.stderr, flush=True)
    return gone
