"""The worker's per-sequence sampling rows: built once when nothing in them depends on the step,
rebuilt every step while min_tokens bans apply; they read the sequence's output list in place."""

from phloem.sampling_params import SamplingParams
from phloem.worker.input_batch import SequenceState, sampling_row


def test_static_rows_are_built_once_and_see_new_outputs():
    state = SequenceState([5, 6], [], SamplingParams(temperature=0.0, max_tokens=4))
    row = sampling_row(state, 0, None, eos_token_id=2)
    state.output_token_ids.append(9)  # the worker appends its sampled tokens in place
    again = sampling_row(state, 1, None, eos_token_id=2)
    assert again is row and list(again.output_token_ids) == [9]
    # the same sequence sent again (resumed after preemption) is a new state: a new row
    resumed = SequenceState([5, 6], [9], SamplingParams(temperature=0.0, max_tokens=4))
    assert sampling_row(resumed, 1, None, eos_token_id=2) is not row


def test_min_tokens_rows_follow_the_step():
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=1, stop_token_ids=[7])
    state = SequenceState([5], [], params)
    assert sorted(sampling_row(state, 0, None, eos_token_id=2).banned_token_ids) == [2, 7]
    state.output_token_ids.append(3)
    assert list(sampling_row(state, 1, None, eos_token_id=2).banned_token_ids) == []
    assert state.row is None  # never cached
