"""phloem.core must import without torch (it holds integers only)."""

import subprocess
import sys

CODE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in phloem.core")
        return None
sys.meta_path.insert(0, Block())
import pkgutil, importlib, phloem.core
for m in pkgutil.iter_modules(phloem.core.__path__):
    importlib.import_module("phloem.core." + m.name)
import phloem.sampling_params, phloem.config
assert "torch" not in sys.modules
print("ok")
"""


def test_core_imports_without_torch():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
