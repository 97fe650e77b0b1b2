"""Test-wide settings: no network, no spinning OpenMP threads, shared tiny-model fixtures."""

import importlib
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Our Triton kernels run under the interpreter on machines without a GPU. Triton reads
# TRITON_INTERPRET when a kernel module is imported (and some test modules' imports pull triton in
# early), so choose it here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def embedded_tokenizer_dir(tmp_path_factory):
    """The embedded model's tokenizer saved as plain HF tokenizer files (for tiny test models).
    Skips where the embedded model's package is not installed (e.g. a GPU machine)."""
    import importlib.util

    from phloem.models.loader import EMBEDDED_PACKAGE, load_tokenizer, resolve_model

    if importlib.util.find_spec(EMBEDDED_PACKAGE) is None:  # its data only: never imported
        pytest.skip(f"the embedded model's package {EMBEDDED_PACKAGE} is not installed")

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
