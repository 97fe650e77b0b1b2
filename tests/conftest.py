"""Test-wide settings: no network, no spinning OpenMP threads, the checkpoint cache in a session
temp dir, and shared fixtures (the embedded engine, tiny-model tokenizer files)."""

import importlib
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (`-n 2` in pyproject's addopts) each worker runs one torch thread (and so do
# the servers and jobs its tests start): two workers on CI's two cores, none oversubscribed.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Our Triton kernels run under the interpreter on machines without a GPU. Triton reads
# TRITON_INTERPRET when a kernel module is imported (and some test modules' imports pull triton in
# early), so choose it here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def phloem_cache_dir(tmp_path_factory):
    """The converted-checkpoint cache of this session: a fresh temp dir (exported as
    PHLOEM_CACHE_DIR, so subprocesses share it), never ~/.cache. The first test that loads the
    embedded model converts it (the first-start path); later loads, in-process or not, reuse it."""
    from phloem.models.checkpoint_cache import CACHE_DIR_ENV

    path = tmp_path_factory.mktemp("phloem_cache")
    previous = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = previous


def _require_embedded_package() -> None:
    import importlib.util

    from phloem.models.loader import EMBEDDED_PACKAGE

    if importlib.util.find_spec(EMBEDDED_PACKAGE) is None:  # its data only: never imported
        pytest.skip(f"the embedded model's package {EMBEDDED_PACKAGE} is not installed")


@pytest.fixture(scope="session")
def embedded_llm(phloem_cache_dir):
    """One engine on the embedded model for the whole session, for tests that only generate with
    it (never change its settings): `LLM(max_num_batched_tokens=64)`, a small budget so chunked
    prefill mixes with decode. Tests that need other settings build their own engine."""
    _require_embedded_package()
    from phloem import LLM

    return LLM(max_num_batched_tokens=64, dtype="float32")  # compared with float32 references


@pytest.fixture(scope="session")
def embedded_tokenizer_dir(tmp_path_factory):
    """The embedded model's tokenizer saved as plain HF tokenizer files (for tiny test models).
    Skips where the embedded model's package is not installed (e.g. a GPU machine)."""
    from phloem.models.loader import load_tokenizer, resolve_model

    _require_embedded_package()
    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def triton_kernels():
    """`triton_kernels(module_name, jit_name)`: the imported module when its Triton kernel
    `jit_name` can run here (compiled on a GPU, or interpreted on the CPU: TRITON_INTERPRET, set
    above, must have been read when the module was imported); skips the test otherwise."""

    def load(module_name: str, jit_name: str):
        pytest.importorskip("triton")
        from triton.runtime.interpreter import InterpretedFunction

        module = importlib.import_module(module_name)
        interpreted = isinstance(getattr(module, jit_name), InterpretedFunction)
        if not torch.cuda.is_available() and not interpreted:
            pytest.skip("triton kernels are compiled, not interpreted, and there is no GPU")
        return module

    return load


@pytest.fixture
def compile_for_hopper(tmp_path):
    """`compile_for_hopper(code)`: run `code` (Python that calls `triton.compile` for
    `GPUTarget("cuda", 90, 32)`) in a process without TRITON_INTERPRET and a cache of its own,
    and return its stdout; fails the test with the compiler's error when the process fails.
    Triton's frontend, PTX and ptxas run on the CPU: the interpreter accepts kernels that the
    GPU compiler rejects, this does not."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)

    def run(code: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                              capture_output=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        return done.stdout

    return run
