"""Prefix reuse on the mesh (issue 45 item 3): the prompt's block hash chain and what a route holds of it.

The chain names a prompt's prefixes without its text: ``chain[k]`` is a SHA-256 over the model's hash and the
token ids of blocks ``0 .. k`` (:data:`~ethen.mesh.worker.prefixes.PREFIX_BLOCK` tokens each), so it names
tokens ``0 .. (k+1)*64 - 1`` and two models never share a name. Workers report the prefixes they hold as
``"<hash>@<fragment first layer>"`` in Health (:mod:`ethen.mesh.worker.prefixes`).

A stage (node, layers ``first..last``) holds ``chain[k]`` when every fragment the node serves inside those
layers does. A route can skip a prefix only when *every* stage holds it (a stage that does not would need the
prefix's hidden states, which the stages before it no longer compute), so a route's cached prefix is the
minimum over its stages. The first step always computes at least one position (the first token's logits).
Everything here is pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ethen.mesh.routing import Route
from ethen.mesh.worker.prefixes import PREFIX_BLOCK

__all__ = ["PREFIX_BLOCK", "PrefixHolding", "cached_blocks", "fragment_cached_tokens", "prefix_chain",
           "route_cached_tokens", "usable_tokens"]


def prefix_chain(model_key: str, token_ids: Sequence[int]) -> tuple[str, ...]:
    """The hash chain of ``token_ids``' whole blocks (a trailing partial block is not named)."""
    h = hashlib.sha256(f"ethen-prefix/{model_key}".encode()).digest()
    out: list[str] = []
    for k in range(len(token_ids) // PREFIX_BLOCK):
        block = token_ids[k * PREFIX_BLOCK : (k + 1) * PREFIX_BLOCK]
        h = hashlib.sha256(h + b"".join(int(t).to_bytes(4, "little", signed=True) for t in block)).digest()
        out.append(h.hex()[:32])
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PrefixHolding:
    """What one node reported: its fragments and the ``hash@fragment`` names it holds."""

    fragments: tuple[tuple[int, int], ...]
    names: frozenset[str]


def cached_blocks(chain: Sequence[str], holding: PrefixHolding, first: int, last: int) -> int:
    """Blocks of ``chain`` the node holds for every one of its fragments inside ``first..last``."""
    frags = [a for a, b in holding.fragments if first <= a and b <= last]
    if not frags:
        return 0
    for k in range(len(chain), 0, -1):
        if all(f"{chain[k - 1]}@{f}" in holding.names for f in frags):
            return k
    return 0


def usable_tokens(blocks: int, prompt_tokens: int) -> int:
    """Cached positions a prompt of ``prompt_tokens`` may skip: whole blocks, leaving at least one position
    to compute (the first token's logits)."""
    return max(0, min(blocks * PREFIX_BLOCK, (prompt_tokens - 1) // PREFIX_BLOCK * PREFIX_BLOCK))


def route_cached_tokens(route: Route, chain: Sequence[str], holdings: Mapping[str, PrefixHolding],
                        prompt_tokens: int) -> int:
    """Positions of the prompt every stage of ``route`` holds (0 when one stage holds none)."""
    blocks = [cached_blocks(chain, holdings[s.node_id], s.first, s.last) if s.node_id in holdings else 0
              for s in route.stages]
    if not blocks:
        return 0
    return usable_tokens(min(blocks), prompt_tokens)


def fragment_cached_tokens(chain: Sequence[str], holdings: Mapping[str, PrefixHolding],
                           nodes: Iterable[str], prompt_tokens: int) -> dict[str, dict[int, int]]:
    """Per node and fragment (its first layer), the prompt positions it holds and a first step may skip
    (the routing's ``cached`` input, :func:`~ethen.mesh.routing.score_route_cached`); nodes holding none
    are left out."""
    out: dict[str, dict[int, int]] = {}
    for node in nodes:
        holding = holdings.get(node)
        if holding is None:
            continue
        frags = {a: usable_tokens(cached_blocks(chain, holding, a, b), prompt_tokens)
                 for a, b in holding.fragments}
        if any(frags.values()):
            out[node] = frags
    return out
