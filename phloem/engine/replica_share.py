"""The wire form of one data-parallel replica's share of a batch (`engine.data_parallel`).

A share is sent as one `Share`: its prompts' token ids packed into one array of 4-byte ids in
which each group's shared prefix appears once (then each member's own suffix), its sampling
parameters once per distinct object, and, under prefix routing, the groups of the driver's
global plan on the share, so that the replica queues them in the plan's order without planning
again (`core.replica_partition.share_plan`). Prompt texts are not sent: a replica never reads
them, and the driver puts them (and the prompt ids) back into the outputs it receives.

```
tokens: |-- prefix g0 --|-- suffix m0 --|-- suffix m1 --| ... |-- prefix g1 --|-- suffix --| ...
         prefix_lens[0]   suffix_lens[0]  suffix_lens[1]        prefix_lens[1]
```

Why: pickling a share as lists of Python ints made each replica unpickle one int object per
prompt token (14 M for batchllm 400 x 16) before its first step, and the driver pickle them,
one replica after another; a packed array is one memory copy each way, and each prefix is in it
once (benchmarks/results/2026-11-26-cpu-dp-dispatch).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from phloem.core.prefix_planner import PrefixPlan
from phloem.core.replica_partition import share_plan
from phloem.sampling_params import SamplingParams

_TOKEN_TYPECODE = "I"  # C unsigned int: 4 bytes on our platforms; ids are below 2**32


@dataclass(frozen=True)
class Share:
    """One replica's share of a batch, as sent (module docstring).

    Attributes:
        indices: the requests' indices in the driver's batch, in the share's order.
        tokens: the packed token ids (array of `_TOKEN_TYPECODE`, as bytes).
        prefix_lens: per group, the tokens its members share and `tokens` holds once.
        group_sizes: per group, its members (the next ones of `indices`).
        suffix_lens: per request, its tokens after its group's prefix.
        params: the distinct sampling parameters; param_index: per request, its entry.
        planned: True when the groups are the driver's plan for the share (the replica queues
            them as they are); False when the replica plans the share itself (contiguous
            routing: every group is one request with prefix_len 0).
        block_size: the plan's tokens per KV block.
    """

    indices: list[int]
    tokens: bytes
    prefix_lens: list[int]
    group_sizes: list[int]
    suffix_lens: list[int]
    params: list[SamplingParams]
    param_index: list[int]
    planned: bool
    block_size: int


def encode_share(
    encoded: Sequence[tuple[str | None, list[int]]],
    params: Sequence[SamplingParams],
    groups: Sequence[tuple[int, Sequence[int]]],
    block_size: int,
    planned: bool,
) -> Share:
    """Pack one share (module docstring).

    Args:
        encoded / params: the driver's whole batch: (text, token ids) and sampling parameters.
        groups: (prefix_len, request indices) per group of the share, in its order; every
            member's prompt starts with the same prefix_len tokens and is longer than that (the
            global plan's promise, `PrefixGroup`).
        planned: whether the replica takes `groups` as its plan (see `Share.planned`).
    Raises:
        ValueError: a token id outside [0, 2**32).
    """
    tokens = array(_TOKEN_TYPECODE)
    indices: list[int] = []
    suffix_lens: list[int] = []
    distinct: dict[int, int] = {}  # id(params) -> its entry
    param_list: list[SamplingParams] = []
    param_index: list[int] = []
    try:
        for prefix_len, members in groups:
            tokens.extend(encoded[members[0]][1][:prefix_len])
            for i in members:
                ids = encoded[i][1]
                tokens.extend(ids[prefix_len:] if prefix_len else ids)
                suffix_lens.append(len(ids) - prefix_len)
                entry = distinct.setdefault(id(params[i]), len(param_list))
                if entry == len(param_list):
                    param_list.append(params[i])
                param_index.append(entry)
            indices.extend(members)
    except OverflowError as e:
        raise ValueError(f"a prompt has a token id outside [0, 2**32): {e}") from None
    return Share(
        indices=indices,
        tokens=tokens.tobytes(),
        prefix_lens=[p for p, _ in groups],
        group_sizes=[len(m) for _, m in groups],
        suffix_lens=suffix_lens,
        params=param_list,
        param_index=param_index,
        planned=planned,
        block_size=block_size,
    )


def decode_share(
    share: Share,
) -> tuple[list[tuple[None, list[int]]], list[SamplingParams], PrefixPlan | None]:
    """Unpack a share on the replica: ((None, token ids) per request in the share's order,
    their sampling parameters, and its plan when `share.planned`, else None).

    Raises:
        ValueError: a share whose lengths do not add up (`share_plan`'s checks, and the token
            count).
    """
    flat = array(_TOKEN_TYPECODE)
    flat.frombytes(share.tokens)
    ids = flat.tolist()
    encoded: list[tuple[None, list[int]]] = []
    at, k = 0, 0
    for prefix_len, size in zip(share.prefix_lens, share.group_sizes):
        prefix = ids[at : at + prefix_len]
        at += prefix_len
        for _ in range(size):
            end = at + share.suffix_lens[k]
            encoded.append((None, prefix + ids[at:end]))
            at, k = end, k + 1
    if at != len(ids) or k != len(share.indices):
        raise ValueError(
            f"a share of {len(share.indices)} requests carries {len(ids)} tokens; its lengths "
            f"add up to {at} tokens and {k} requests"
        )
    params = [share.params[j] for j in share.param_index]
    if not share.planned:
        return encoded, params, None
    lens = [len(p) for _, p in encoded]
    return encoded, params, share_plan(share.prefix_lens, share.group_sizes, lens, share.block_size)
