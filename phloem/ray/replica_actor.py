"""One replica actor of a Ray job: a phloem `LLM` built once per actor, run over whole batches
of planned rows (Ray Data's actor-pool UDF, `Dataset.map_batches`).

A batch arrives as columns (Ray Data's numpy format) and leaves with the input's columns, less
the routing ones, plus the generated ones:

    in:  ROW (int), TOKEN_IDS (list of int), PARAMS (pickled SamplingParams), SHARE, GROUP
         (ints), and the user's own columns
    out: the user's columns, "row_index" (= ROW), and either the generated columns of
         `GENERATED_COLUMNS` (the processor) or REQUEST_OUTPUT (a pickled `RequestOutput`,
         for `RayEngine`), plus STATS; debug columns on request

One call runs the whole batch through `LLM.generate`, so the actor's own planner sees every
group of the batch at once and finds the groups the driver's global plan dealt to it.
"""

from __future__ import annotations

import json
import pickle
import time
from typing import Any

ROW = "__phloem_row"
TOKEN_IDS = "__phloem_token_ids"
PARAMS = "__phloem_params"
SHARE = "__phloem_share"
GROUP = "__phloem_group"
ROUTING_COLUMNS = (ROW, TOKEN_IDS, PARAMS, SHARE, GROUP)
REQUEST_OUTPUT = "__phloem_request_output"
STATS = "__phloem_batch_stats"  # JSON: the batch's computed prompt tokens and wall time
GENERATED_COLUMNS = (
    "generated_text",
    "generated_token_ids",
    "num_generated_tokens",
    "num_input_tokens",
    "finish_reason",
    "error",
)
DEBUG_COLUMNS = ("phloem_actor_id", "phloem_share", "phloem_group")


class PhloemReplica:
    """Ray Data actor UDF: `LLM(model, **engine_kwargs)` loaded once, then one `generate` per
    batch (module docstring).

    Args:
        model / engine_kwargs: as `LLM(model, **engine_kwargs)` (data_parallel_size 1: the
            actor is one replica).
        request_outputs: return each row's pickled `RequestOutput` (REQUEST_OUTPUT) instead of
            the generated columns.
        debug_columns: add `DEBUG_COLUMNS`.
    Raises:
        ValueError, TypeError: as `LLM(...)` (the actor fails to start and Ray names it).
    """

    def __init__(
        self,
        model: str | None,
        engine_kwargs: dict[str, Any],
        request_outputs: bool = False,
        debug_columns: bool = False,
    ) -> None:
        import ray

        from phloem.engine.llm import LLM

        self.llm = LLM(model, **engine_kwargs)
        self.request_outputs = request_outputs
        self.debug_columns = debug_columns
        self.actor_id = ray.get_runtime_context().get_actor_id()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Generate for every row of `batch` (columns of equal length, numpy arrays) and return
        its columns as the module docstring says. Raises what `LLM.generate` raises."""
        import numpy as np

        start = time.monotonic()
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in batch[TOKEN_IDS]]
        params = [pickle.loads(p) for p in batch[PARAMS]]
        engine = self.llm.llm_engine
        computed = engine.num_computed_prompt_tokens
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        computed = engine.num_computed_prompt_tokens - computed
        out = {k: v for k, v in batch.items() if k not in ROUTING_COLUMNS}
        out["row_index"] = np.asarray(batch[ROW], dtype=np.int64)
        if self.request_outputs:
            out[REQUEST_OUTPUT] = _objects([pickle.dumps(o) for o in outputs])
        else:
            out.update(generated_columns(outputs))
        stats = {
            "first_row": int(batch[ROW][0]),  # names the batch
            "num_computed_prompt_tokens": computed,
            "wall_s": time.monotonic() - start,
        }
        out[STATS] = _objects([json.dumps(stats)] * len(outputs))
        if self.debug_columns:
            out["phloem_actor_id"] = _objects([self.actor_id] * len(outputs))
            out["phloem_share"] = np.asarray(batch[SHARE], dtype=np.int64)
            out["phloem_group"] = np.asarray(batch[GROUP], dtype=np.int64)
        return out


def generated_columns(outputs: list) -> dict[str, Any]:
    """The `GENERATED_COLUMNS` of n = 1 outputs (`RequestOutput`s) in order: the completion's
    text, token ids, counts and finish reason; `error` is None unless the request failed in
    the engine (then the others are empty)."""
    import numpy as np

    first = [o.outputs[0] if o.outputs and o.error is None else None for o in outputs]
    return {
        "generated_text": _objects([c.text if c else "" for c in first]),
        "generated_token_ids": _objects([list(c.token_ids) if c else [] for c in first]),
        "num_generated_tokens": np.asarray([len(c.token_ids) if c else 0 for c in first]),
        "num_input_tokens": np.asarray([len(o.prompt_token_ids) for o in outputs]),
        "finish_reason": _objects([c.finish_reason if c else None for c in first]),
        "error": _objects([o.error for o in outputs]),
    }


def _objects(values: list) -> Any:
    """A 1-d numpy object array of `values` (lists stay lists, not a 2-d array)."""
    import numpy as np

    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array
