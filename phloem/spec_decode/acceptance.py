"""Acceptance-rate estimates of speculative decoding, per request and per proposer, for the cost
rule (`cost_rule.choose_num_drafts`). Pure Python.

Acceptance rates are exponential moving averages per request and per proposer (one
`AcceptanceTracker` per proposer), a request's estimate leaning on the proposer's global rate until
it has trials of its own; besides the overall rate, one over the drafts that followed an accepted
draft and one over the first drafts after a rejection (`AcceptanceTracker.chain`). A request held
at k = 0 is probed again after `probe_after` steps at the prior rate, so a rate that fell once can
recover.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AcceptanceConfig:
    """Settings of the acceptance estimates.

    Attributes:
        ema_weight: weight of each new draft trial in the moving averages, in (0, 1].
        prior: the rate assumed before any trial, in [0, 1].
        prior_trials: how many trials of its own a request needs before its estimate leans
            equally on its own rate and the proposer's global one [trials], >= 0.
        probe_after: steps at k = 0 after which a request's estimate is raised to the prior
            once, so it is tried again [steps], >= 1.
    """

    ema_weight: float = 0.1
    prior: float = 0.5
    prior_trials: float = 4.0
    probe_after: int = 32

    def validate(self) -> None:
        """Raise ValueError naming the field out of range."""
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must lie in (0, 1], got {self.ema_weight}")
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"prior must lie in [0, 1], got {self.prior}")
        if self.prior_trials < 0:
            raise ValueError(f"prior_trials must be >= 0, got {self.prior_trials}")
        if self.probe_after < 1:
            raise ValueError(f"probe_after must be >= 1, got {self.probe_after}")


@dataclass
class _RequestRate:
    rate: float
    after_accept: float
    after_reject: float
    num_trials: int = 0
    num_after_accept: int = 0
    num_after_reject: int = 0
    hot: bool = False  # its last verify accepted every draft
    steps_off: int = 0


class AcceptanceTracker:
    """Per-draft acceptance rates of one proposer: per request and global, an EMA over all
    trials and one over each state of the chain (see the module docstring).

    A verify of k drafts with a accepted is a + [a < k] Bernoulli trials: a successes, then the
    rejection (none when all k were accepted; the bonus token is not a trial). Its first trial
    follows an accepted draft when the request's previous verify accepted all of its drafts;
    the others always do.
    """

    def __init__(self, config: AcceptanceConfig | None = None) -> None:
        self.config = config or AcceptanceConfig()
        self.config.validate()
        prior = self.config.prior
        self.global_rate = self.global_after_accept = self.global_after_reject = prior
        self._requests: dict[str, _RequestRate] = {}

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """Record one verify; raises ValueError unless 0 <= num_accepted <= num_drafts."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"num_accepted must lie in [0, num_drafts = {num_drafts}]")
        state = self._state(request_id)
        state.steps_off = 0
        outcomes = [1.0] * num_accepted + ([0.0] if num_accepted < num_drafts else [])
        w = self.config.ema_weight
        for j, x in enumerate(outcomes):
            state.rate += w * (x - state.rate)
            self.global_rate += w * (x - self.global_rate)
            if j or state.hot:
                state.after_accept += w * (x - state.after_accept)
                self.global_after_accept += w * (x - self.global_after_accept)
                state.num_after_accept += 1
            else:
                state.after_reject += w * (x - state.after_reject)
                self.global_after_reject += w * (x - self.global_after_reject)
                state.num_after_reject += 1
        state.num_trials += len(outcomes)
        state.hot = num_drafts > 0 and num_accepted == num_drafts

    def chain_broken(self, request_id: str) -> None:
        """The request's last verify row verified nothing (its drafts followed a guess of its
        pending token that failed): no trial, but the token after its accepted run was not the
        proposer's, so its next drafts are rated as first drafts after a rejection."""
        self._state(request_id).hot = False

    def skipped(self, request_id: str) -> None:
        """The request had drafts to offer but verified none this step (k = 0)."""
        state = self._state(request_id)
        state.steps_off += 1
        state.hot = False

    def rate(self, request_id: str) -> float:
        """The request's estimate: its EMA and the global one weighted by its trials against
        `prior_trials`; at least the prior once it has been off for `probe_after` steps."""
        state = self._state(request_id)
        return self._probed(state, self._blend(state.rate, state.num_trials, self.global_rate))

    def chain(self, request_id: str) -> tuple[float, float]:
        """(first draft's rate, rate of each draft after it) of the request's next verify (the
        module docstring's a and c), each blended with the global rates as in `rate`. After a
        verify that accepted every draft: both the rate after an accepted draft h (a run of
        copied text goes on); else the rate of first drafts after a rejection, then the lower of
        the overall rate and h: a request ramps up (few drafts until a verify accepts all of
        them, then as many as pay). Both at least the prior once it has been off for
        `probe_after` steps."""
        state = self._state(request_id)
        hot = self._blend(state.after_accept, state.num_after_accept, self.global_after_accept)
        if state.hot:
            return self._probed(state, hot), self._probed(state, hot)
        cold = self._blend(state.after_reject, state.num_after_reject, self.global_after_reject)
        return self._probed(state, cold), self._probed(state, min(hot, self.rate(request_id)))

    def _blend(self, own: float, num_trials: int, global_rate: float) -> float:
        n, n0 = num_trials, self.config.prior_trials
        return (n * own + n0 * global_rate) / (n + n0) if n + n0 else own

    def _probed(self, state: _RequestRate, estimate: float) -> float:
        if state.steps_off >= self.config.probe_after:
            return max(estimate, self.config.prior)
        return estimate

    def finish(self, request_id: str) -> None:
        """Forget the request (its trials stay in the global rates)."""
        self._requests.pop(request_id, None)

    def _state(self, request_id: str) -> _RequestRate:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestRate(
                self.global_rate, self.global_after_accept, self.global_after_reject
            )
        return state
