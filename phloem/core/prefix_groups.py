"""The lifecycle of runtime prefix groups (`SharedPrefix`): leader, hold, attach, idle release.

BatchLLM §4.2 groups (and the n > 1 samples of one prompt) share a prefix computed once:

- the first member admitted becomes the group's *leader* and computes the prefix as part of its
  own prompt; other members wait while it runs (`attach` returns False);
- when the leader's KV covers the prefix, the group *holds* one reference to those blocks
  (`on_computed`) and every later member starts from them (`attach`);
- the hold lives as long as the group (released when its last member finishes, `on_finished`),
  or until KV runs short while the group is *idle* (no member running): idle holds are released
  before any running request is preempted (`release_idle_until_allocated`, `release_idle`),
  and a later member recomputes the prefix as the new leader.

The scheduler calls these hooks; this module owns no queue. A fresh request without a group (or
whose group holds nothing) starts from the radix cache instead.
"""

from __future__ import annotations

from collections import deque

from phloem.core.admission import Admission
from phloem.core.kv_manager import KVManager
from phloem.core.request import Request, RequestStatus, SharedPrefix


class PrefixGroups:
    """Runtime prefix groups over one KV manager (see the module docstring).

    Args:
        kv_manager: holds and releases the groups' blocks, attaches them to members.
        admission: the admission rule `held_prefix_admissible` applies.
    """

    def __init__(self, kv_manager: KVManager, admission: Admission) -> None:
        self.kv = kv_manager
        self.admission = admission

    def attach(self, request: Request) -> bool:
        """Start a fresh request from reusable KV: its group's held prefix, else the radix
        cache. Returns False when the group's prefix is being computed by a running leader (the
        request waits for it rather than computing it again). Mutates the request's block table
        and `num_computed_tokens`.

        A member readmitted after preemption starts from the radix cache when it holds more of
        its prompt than the group's prefix (its own blocks, cached when it was preempted): from
        the group's blocks alone it would compute them again beside the cached copy, which its
        cache lock then pins, and a pool that fits it once may not fit both (it would preempt
        itself for ever)."""
        if request.num_computed_tokens > 0:
            return True
        group = request.shared_prefix
        if group is not None:
            if group.block_ids is not None and not self._cache_covers_more(request, group):
                self.kv.attach_blocks(request, group.block_ids, group.prefix_len)
                return True
            leader = group.leader
            if (
                leader is not None
                and leader is not request
                and leader.status is RequestStatus.RUNNING
            ):
                return False
        self.kv.match_prefix_cache(request)
        return True

    def _cache_covers_more(self, request: Request, group: SharedPrefix) -> bool:
        """A member readmitted after preemption whose prompt the radix cache holds beyond the
        group's prefix (see `attach`); False at once for a request never preempted."""
        return bool(request.num_preemptions) and (
            self.kv.num_cached_prefix_tokens(request) > group.prefix_len
        )

    def detach(self, request: Request) -> None:
        """Undo `attach` for a request that could not be admitted this step."""
        if request.status is not RequestStatus.RUNNING:
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.num_cached_tokens = 0

    def held_prefix_admissible(
        self, request: Request, budget: int, reserved: int, running: list[Request]
    ) -> bool | None:
        """`Admission.admissible` before attaching, for a fresh request whose group holds its
        prefix; None for any other request (its start comes from the radix cache, whose match
        also stamps the tree, so it is attached first and checked after).

        Attaching a held prefix only adds references: it changes neither the free nor the
        evictable blocks, and from an empty block table the blocks to finish drop by exactly
        the prefix's blocks (every member ends past its prefix). So the answer is the one after
        attaching, and a queue head that does not fit a full pool is not attached and detached
        again in every step.
        """
        group = request.shared_prefix
        if request.num_computed_tokens or group is None or group.block_ids is None:
            return None
        if self._cache_covers_more(request, group):
            return None  # it starts from the radix cache (`attach`): attached, then checked
        num_blocks = len(group.block_ids)
        return self.admission.admissible(
            request, budget, reserved, group.prefix_len, running, num_blocks
        )

    def on_admitted(self, request: Request) -> None:
        """A member admitted while its group holds nothing computes the prefix: the leader.
        One that starts with the whole prefix (found in the radix cache) hands it to the group
        at once, so the other members need not wait for a step."""
        group = request.shared_prefix
        if group is not None and group.block_ids is None:
            if request.num_computed_tokens >= group.prefix_len:
                self.kv.hold_shared_prefix(group, request)
            else:
                group.leader = request

    def on_computed(self, request: Request) -> None:
        """After a step of a running request: a leader whose KV now covers the prefix hands it
        to the group (one reference held by the group)."""
        group = request.shared_prefix
        if (
            group is not None
            and group.leader is request
            and request.num_computed_tokens >= group.prefix_len
        ):
            self.kv.hold_shared_prefix(group, request)
            group.leader = None

    def on_preempted(self, request: Request) -> None:
        group = request.shared_prefix
        if group is not None and group.leader is request:
            group.leader = None

    def on_finished(self, request: Request) -> None:
        """A member finished: the group's last one releases the hold."""
        group = request.shared_prefix
        if group is None:
            return
        group.num_unfinished -= 1
        if group.leader is request:
            group.leader = None
        if group.num_unfinished == 0:
            self.kv.release_shared_prefix(group)

    def release_idle_until_allocated(
        self, request: Request, num_new: int, running: list[Request], waiting: deque[Request]
    ) -> bool:
        """Drop held prefixes of groups with no running member, the group whose next member
        waits furthest back in the queue first, until `allocate_slots(request, num_new)`
        succeeds. Returns True if it did (some prefixes may be released even when not)."""
        idle = {id(group): group for group in self.idle_held(running)}
        if not idle:
            return False
        needed_at: dict[int, int] = {}  # group -> queue position of its first waiting member
        for position, queued in enumerate(waiting):
            group = queued.shared_prefix
            if group is not None and id(group) in idle and id(group) not in needed_at:
                needed_at[id(group)] = position
                if len(needed_at) == len(idle):
                    break
        # every idle group has a waiting member (unfinished ones, none running); the default
        # is only a guard
        for key in sorted(idle, key=lambda k: needed_at.get(k, len(waiting)), reverse=True):
            self.kv.release_shared_prefix(idle[key])
            if self.kv.allocate_slots(request, num_new):
                return True
        return False

    def release_idle(self, running: list[Request]) -> bool:
        """When nothing can run, drop all held prefixes of groups with no running member (they
        are recomputed later) so the head of the queue can be admitted. Returns True if any."""
        idle = self.idle_held(running)
        for group in idle:
            self.kv.release_shared_prefix(group)
        return bool(idle)

    def idle_held(self, running: list[Request]) -> list[SharedPrefix]:
        """Held prefixes of groups with no running member, in the KV manager's order."""
        held = self.kv.held_shared_prefixes()
        if not held:
            return []
        busy = {id(r.shared_prefix) for r in running if r.shared_prefix is not None}
        return [group for group in held if id(group) not in busy]
