"""The `phloem` command line builds without the server's extras (GPU machines may lack them)."""

import subprocess
import sys

CODE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "fastapi", "uvicorn", "prometheus_client"):
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
from phloem.entrypoints.cli import build_parser
args = build_parser().parse_args(["generate", "-i", "in.jsonl", "-o", "out.jsonl"])
assert args.command == "generate"
print("ok")
"""


def test_parser_builds_without_server_extras():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
