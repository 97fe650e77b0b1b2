"""`phloem.ray.build_processor`: a `ray.data.Dataset` of rows through phloem replica actors,
with prefix-aware routing (the shape of Ray Data's `build_processor`; issue 16).

```
rows -> preprocess (Ray Data map) -> {"prompt" | "messages" | "prompt_token_ids",
                                      "sampling_params"?, the user's columns}
     -> driver: read the rows, tokenize, ONE PrefixPlan, deal groups to `concurrency` shares
     -> one block per share (or per run of whole groups) -> actor pool, LLM.generate per block
     -> rows + generated columns + "row_index" -> postprocess (Ray Data map) -> rows
```

The planning pass reads the preprocessed rows onto the driver when the processor is called
(planning needs every prompt); generation and postprocess stay lazy, like any Dataset. So the
rows must fit in the driver's memory (`engine.RayEngine` and docs/DESIGN.md say why the plan is
global). Every output row carries "row_index", the row's position in the order the planning
pass read the dataset (its input order when the dataset's DataContext preserves order): Ray
Data does not keep row order across stages, and `ds.sort("row_index")` restores it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phloem.core.prefix_planner import PrefixPlan
from phloem.ray.config import PhloemProcessorConfig
from phloem.ray.engine import RayLLM, generation_stage, routing_row, share_blocks
from phloem.ray.replica_actor import STATS
from phloem.sampling_params import SamplingParams

Row = dict[str, Any]
_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


def plain(value: Any) -> Any:
    """`value` with numpy arrays and scalars (as Ray Data hands a row's lists and numbers back)
    turned into Python lists and numbers, through dicts and lists."""
    import numpy as np

    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class Processor:
    """Maps a Dataset of rows to a Dataset of rows with generated text (`build_processor`).

    Output columns, beside the preprocessed row's own (which postprocess sees too):
    `generated_text`, `generated_token_ids`, `num_generated_tokens`, `num_input_tokens`,
    `finish_reason`, `error` (None, or why the request failed in the engine) and `row_index`;
    with `config.debug_columns` also `phloem_actor_id`, `phloem_share`, `phloem_group`.
    """

    def __init__(
        self,
        config: PhloemProcessorConfig,
        preprocess: Callable[[Row], Row] | None = None,
        postprocess: Callable[[Row], Row] | None = None,
        preprocess_map_kwargs: dict[str, Any] | None = None,
        postprocess_map_kwargs: dict[str, Any] | None = None,
    ) -> None:
        config.engine_args()  # refuse bad settings now, before any data moves
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.preprocess_map_kwargs = preprocess_map_kwargs or {}
        self.postprocess_map_kwargs = postprocess_map_kwargs or {}
        self._planner: RayLLM | None = None
        self.last_plan: PrefixPlan | None = None  # the global plan of the last call

    @property
    def planner(self) -> RayLLM:
        """The driver's tokenizer, checks and planner (loads no weights), made on first use."""
        if self._planner is None:
            self._planner = RayLLM(self.config)
        return self._planner

    def __call__(self, dataset: Any) -> Any:
        """Plan `dataset` (a `ray.data.Dataset`) now and return the lazy Dataset of its
        generated rows, exactly one per input row (module docstring).

        Raises:
            ValueError: naming the row (its position) and the field, for a row without exactly
                one of "prompt", "messages", "prompt_token_ids", for bad sampling_params
                (n > 1 included: one output row per input row), or a prompt too long.
        """
        pre = dataset.map(self.preprocess, **self.preprocess_map_kwargs) if self.preprocess \
            else dataset  # fmt: skip
        rows = [plain(r) for r in pre.take_all()]
        llm = self.planner
        encoded, params = [], []
        for i, row in enumerate(rows):
            try:
                ids, sampling = self._encode(row)
            except (ValueError, TypeError) as e:
                raise ValueError(f"row {i}: {e}") from None
            encoded.append((None, ids))
            params.append(sampling)
        plan = llm.plan([ids for _, ids in encoded], params)
        self.last_plan = plan
        engine = llm.llm_engine
        deal = engine.deal(encoded, params, plan)
        blocks = [
            [{**rows[i], **routing_row(i, encoded[i][1], params[i], share,
                                       plan.request_group[i])} for i in b]
            for share, b in share_blocks(deal, plan.request_group, self.config.batch_size)
        ]  # fmt: skip
        out = generation_stage(blocks, self.config, request_outputs=False)
        out = out.drop_columns([STATS]) if rows else out
        if self.postprocess is not None:
            out = out.map(self.postprocess, **self.postprocess_map_kwargs)
        return out

    def _encode(self, row: Row) -> tuple[list[int], SamplingParams]:
        """(token ids, sampling parameters) of one preprocessed row, checked against the model.
        Raises ValueError / TypeError naming the field."""
        llm = self.planner
        present = [f for f in _PROMPT_FIELDS if row.get(f) is not None]
        if len(present) != 1:
            raise ValueError(f"a row needs exactly one of {_PROMPT_FIELDS}, got {present}")
        if present[0] == "messages":
            ids = llm.encode_chat(row["messages"])[1]
        elif present[0] == "prompt":
            if not isinstance(row["prompt"], str):
                raise ValueError("field 'prompt' must be a string")
            ids = llm.encode_prompt(row["prompt"])[1]
        else:
            ids = llm.encode_prompt({"prompt_token_ids": row["prompt_token_ids"]})[1]
        values = row.get("sampling_params") or {}
        if not isinstance(values, dict):
            raise ValueError("field 'sampling_params' must be a dict of SamplingParams fields")
        sampling = SamplingParams.from_dict({k: v for k, v in values.items() if v is not None})
        if sampling.n != 1:
            raise ValueError(
                f"sampling_params.n must be 1 (one output row per row), got {sampling.n}"
            )
        llm.llm_engine.validate_params(sampling)
        llm.llm_engine.validate_prompt(ids)
        return ids, sampling


def build_processor(
    config: PhloemProcessorConfig,
    preprocess: Callable[[Row], Row] | None = None,
    postprocess: Callable[[Row], Row] | None = None,
    preprocess_map_kwargs: dict[str, Any] | None = None,
    postprocess_map_kwargs: dict[str, Any] | None = None,
) -> Processor:
    """A `Processor` of `config`: `processor(dataset)` returns the generated Dataset.

    Args:
        preprocess: row -> row with one of "prompt" (str), "messages" (chat) or
            "prompt_token_ids", and optionally "sampling_params" (a dict of `SamplingParams`
            fields, n = 1); run as a Ray Data `map` with `preprocess_map_kwargs`.
        postprocess: output row -> the user's row; a Ray Data `map` with
            `postprocess_map_kwargs`.
    Raises:
        ValueError, TypeError: naming the field, for invalid settings in `config`.
    """
    return Processor(config, preprocess, postprocess, preprocess_map_kwargs,
                     postprocess_map_kwargs)  # fmt: skip
