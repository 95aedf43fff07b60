"""What one butterfly all-reduce moves: each member's payload bytes up and down, from the node's own
partition (:meth:`Group.partition`), chunking (:func:`chunk_sizes`) and codecs.

A member sends every other owner's part of its vector, encoded chunk by chunk in the round's codec,
and, as an owner, sends each other member the result of its own part in the result codec; it
receives the mirror image. These are the bytes the node counts in ``bytes_sent`` /
``bytes_received`` (payloads, without gRPC framing).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import torch

from swarmgrad.compression import get_codec
from swarmgrad.node.averaging.group import Group, chunk_sizes
from swarmgrad.node.averaging.plan import AllReduceConfig


@dataclass(frozen=True, slots=True)
class Traffic:
    sent: int
    received: int


@functools.cache
def payload_nbytes(codec: str, options: tuple[tuple[str, float], ...], numel: int) -> int:
    """Bytes of one encoded chunk of ``numel`` values: the codec run on random values once."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    payload, _meta = get_codec(codec, **dict(options)).encode(values)
    return len(payload)


def part_bytes(config: AllReduceConfig, numel: int, *, result: bool = False) -> int:
    """Payload bytes of a part of ``numel`` values, as members send it or (``result``) as its
    owner sends the result back."""
    options: tuple[tuple[str, float], ...] = ()
    if result and config.result_codec:
        codec = config.result_codec
    else:
        codec, options = config.codec, tuple(sorted(config.codec_options.items()))
    return sum(payload_nbytes(codec, options, n) for n in chunk_sizes(numel, config.chunk_values))


def round_traffic(
    group: Group, total: int, config: AllReduceConfig, taking_part: Collection[int] | None = None
) -> dict[int, Traffic]:
    """Each member's bytes (by index) in a round of a ``total``-value vector among the members
    ``taking_part`` (default: all); the parts are cut over the whole group, as the node does, and
    the parts of members not taking part move nothing."""
    active = sorted(range(len(group.members)) if taking_part is None else taking_part)
    parts = group.partition(total)
    sizes = {i: parts[i][1] - parts[i][0] for i in active}
    chunks = {i: part_bytes(config, sizes[i]) for i in active}
    results = {i: part_bytes(config, sizes[i], result=True) for i in active}
    all_chunks, all_results, others = sum(chunks.values()), sum(results.values()), len(active) - 1
    return {
        i: Traffic(
            sent=all_chunks - chunks[i] + others * results[i],
            received=others * chunks[i] + all_results - results[i],
        )
        for i in active
    }
