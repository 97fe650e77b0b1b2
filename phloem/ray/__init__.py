"""phloem.ray: phloem on a Ray cluster (`pip install 'phloem[ray]'`): `build_processor` maps a
`ray.data.Dataset` through phloem replica actors under one global prefix plan, each planned
group's rows on one actor; `RayLLM` is the offline `LLM` over the same actors. Ray itself is
imported only when a job runs, so this package imports without it."""

from phloem.ray.config import PhloemProcessorConfig
from phloem.ray.engine import RayEngine, RayLLM, connect
from phloem.ray.processor import Processor, build_processor

__all__ = [
    "PhloemProcessorConfig",
    "Processor",
    "RayEngine",
    "RayLLM",
    "build_processor",
    "connect",
]
