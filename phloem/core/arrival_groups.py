"""Prefix groups for online arrivals: requests waiting at the same moment, and later ones whose
prefix is still being computed, share one computation of it (the online counterpart of BatchLLM,
Zheng et al., arXiv 2412.03594, §4.1-4.2).

The radix cache (`radix_tree.py`) only knows blocks once computed, so two requests admitted in
one step with the same uncached prefix would both compute it. Before each step's admission,
`ArrivalGroups.plan` turns the requests that arrived since the last step into `SharedPrefix`
groups, which `prefix_groups.py` then runs exactly as the offline ones (the first member admitted
leads and computes the prefix, chunked within the token budget; the others are skipped until
the group holds the leader's prefix blocks, then start from them; the group decodes with the
prefix-shared kernel):

1. the arrivals among themselves: the offline planner's tree and §4.2 gain rule
   (`prefix_planner.plan_prefix_groups`) over the new arrivals only;
2. against requests still unfinished (in flight or waiting): a *pending prefix index*, chained
   hash of a prompt's first k blocks -> the first unfinished online request whose prompt starts
   with those blocks. An arrival (or an arrival group's prefix) found there joins that request's
   group, or makes one with it: if that request has computed the blocks already, the group holds
   them at once; if it is running and has not, it leads and the arrival waits for it; if it
   waits itself, whichever is admitted first leads.

Cost: O(new arrivals x prompt blocks) per step (hashing, index look-ups, the planner over the
arrivals); nothing is rebuilt. A request with nothing to share is never held back: it has no
group (or leads its own), and a member waits at most for its leader's prefill of the prefix
(`PrefixGroups.attach`). Index entries leave with their request (`forget`). A hash hit is
confirmed by comparing the tokens, so a collision can only cost a missed share.

Not shared: an arrival whose common part with a running group's member is shorter than that
group's prefix (it cannot join the group, and its blocks are not cached yet); it starts from the
radix cache like any request.
"""

from __future__ import annotations

from collections.abc import Sequence

from phloem.core.kv_manager import KVManager
from phloem.core.prefix_planner import plan_prefix_groups
from phloem.core.request import Request, RequestStatus, SharedPrefix


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's shareable blocks: entry k - 1 stands for the first k
    blocks; (len - 1) // block_size of them (a member keeps one own token for its logits)."""
    hashes: list[int] = []
    h = 0
    for end in range(block_size, len(token_ids), block_size):
        h = hash((h, tuple(token_ids[end - block_size : end])))
        hashes.append(h)
    return hashes


class ArrivalGroups:
    """Groups online arrivals by common block-aligned prefix (see the module docstring).

    Args:
        kv_manager: the block tables (a group holds the blocks an unfinished request computed).
    """

    def __init__(self, kv_manager: KVManager) -> None:
        self.kv = kv_manager
        self.block_size = kv_manager.block_size
        self._arrivals: list[Request] = []
        self._index: dict[int, Request] = {}  # chained block hash -> first unfinished owner
        self._keys: dict[str, list[int]] = {}  # request id -> the hashes it owns in the index

    def add(self, request: Request) -> None:
        """Note a fresh online request (no group, nothing computed) for the next `plan`."""
        self._arrivals.append(request)

    @property
    def has_arrivals(self) -> bool:
        return bool(self._arrivals)

    def plan(self) -> int:
        """Give this step's arrivals their groups (mutates `shared_prefix` of arrivals and of
        the unfinished requests they share with, groups' `num_unfinished`, `leader`, holds) and
        index their prefixes. Returns the number of arrivals that joined a group."""
        arrivals = [
            r
            for r in self._arrivals
            if r.status is RequestStatus.WAITING and r.shared_prefix is None
        ]
        self._arrivals = []
        hashes = [block_hashes(r.prompt_token_ids, self.block_size) for r in arrivals]
        grouped = self._group_together(arrivals, hashes) if len(arrivals) > 1 else 0
        for request, keys in zip(arrivals, hashes):
            if request.shared_prefix is None:
                num_blocks = self._deepest_match(keys)
                if num_blocks and self._join([request], keys[num_blocks - 1], num_blocks):
                    grouped += 1
        for request, keys in zip(arrivals, hashes):
            self._register(request, keys)
        return grouped

    def forget(self, request: Request) -> None:
        """Drop the index entries a finished (aborted, failed) request owns."""
        keys = self._keys.pop(request.request_id, None)
        if keys is None:
            return
        index = self._index
        for key in keys:
            if index.get(key) is request:
                del index[key]

    # -- internals ------------------------------------------------------------------------------

    def _group_together(self, arrivals: list[Request], hashes: list[list[int]]) -> int:
        """The offline planner's groups among this step's arrivals (BatchLLM §4.1-4.2), each
        joined to a prefix in flight where there is one; returns the arrivals grouped."""
        try:
            plan = plan_prefix_groups(
                [r.prompt_token_ids for r in arrivals], [0] * len(arrivals), self.block_size
            )
        except ValueError:  # a token id outside [0, 2**32): they share through the index only
            return 0
        grouped = 0
        for group in plan.shared_groups:
            members = [arrivals[i] for i in group.request_indices]
            num_blocks = group.prefix_len // self.block_size
            first = group.request_indices[0]
            self._join(members, hashes[first][num_blocks - 1], num_blocks)
            grouped += len(members)
        return grouped

    def _register(self, request: Request, keys: list[int]) -> None:
        """Index the request's prefixes that no unfinished request owns yet."""
        if request.is_finished or not keys:
            return
        owned = []
        index = self._index
        for key in keys:
            if key not in index:
                index[key] = request
                owned.append(key)
        if owned:
            self._keys[request.request_id] = owned

    def _deepest_match(self, keys: list[int]) -> int:
        """Blocks of the longest prefix found in the index (owners hold every shorter one)."""
        index = self._index
        num_blocks = 0
        for key in keys:
            if key not in index:
                break
            num_blocks += 1
        return num_blocks

    def _join(self, members: list[Request], key: int, num_blocks: int) -> bool:
        """Put `members` (arrivals sharing their first `num_blocks` blocks, whose chained hash is
        `key`) in one group: the group of the unfinished request owning `key` when its prefix is
        exactly these blocks or shorter, a new group with that owner when it has none, else a
        new group of the members alone. Returns False when nothing was grouped (a lone arrival
        with no usable owner)."""
        prefix_len = num_blocks * self.block_size
        owner = self._index.get(key)
        if owner is not None and (
            owner.is_finished
            or owner.prompt_token_ids[:prefix_len] != members[0].prompt_token_ids[:prefix_len]
        ):
            owner = None  # a hash collision (or a stale entry): share nothing with it
        group = owner.shared_prefix if owner is not None else None
        if group is not None and group.prefix_len > prefix_len:
            group, owner = None, None  # a longer group: the members cannot start from it
        if group is None:
            if owner is None and len(members) < 2:
                return False
            group = SharedPrefix(prefix_len, num_unfinished=0)
            if owner is not None:
                self._adopt(owner, group)
        for member in members:
            member.shared_prefix = group
            group.num_unfinished += 1
        return True

    def _adopt(self, owner: Request, group: SharedPrefix) -> None:
        """Make the unfinished `owner` (no group yet) a member of the new `group`: it holds the
        owner's blocks at once when the owner has scheduled the whole prefix (any step that reads
        them runs after the one that writes them), else a running owner leads (a waiting one
        competes with the arrivals for the lead at admission)."""
        owner.shared_prefix = group
        owner.table_prefix = None
        group.num_unfinished += 1
        if owner.status is not RequestStatus.RUNNING:
            return
        if owner.num_computed_tokens >= group.prefix_len:
            self.kv.hold_shared_prefix(group, owner)
        else:
            group.leader = owner
