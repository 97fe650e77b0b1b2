"""Token-level stop rules, checked after each new output token.

Stop *strings* need text and are checked by the engine's detokenizer (`phloem.engine.detokenizer`);
everything that can be decided from token ids lives here.
"""

from __future__ import annotations

from phloem.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the request's last output token puts it in, or None to go on.

    Rules, in order: EOS (unless ignore_eos) or a stop_token_id once `min_tokens` exist
    -> FINISHED_STOPPED (stop_reason = the stop token id; None for EOS); `max_tokens` outputs, or
    the context full (`max_model_len` tokens) -> FINISHED_LENGTH. Mutates `request.stop_reason`.
    """
    # Runs for every sampled token: plain attribute reads, no property calls.
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    num_output = len(output_token_ids)
    last = output_token_ids[-1]
    if num_output >= params.min_tokens:
        if not params.ignore_eos and last == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:  # type: ignore[operator]
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    max_tokens = params.max_tokens
    if max_tokens is not None and num_output >= max_tokens:
        return RequestStatus.FINISHED_LENGTH
    # request.num_tokens, spelled out
    if request.num_prompt_tokens + num_output + request.num_pending_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
