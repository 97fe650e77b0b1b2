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


def test_run_batch_prepares_requests_without_the_web_framework():
    """run-batch shares the server's request preparation (`openai.serving`) without importing
    FastAPI or the server module."""
    code = (
        "import sys\n"
        "import phloem.entrypoints.run_batch as rb\n"
        "from phloem.entrypoints.openai.serving import Frontend, prepare_chat, prepare_completion\n"
        "from phloem.entrypoints.openai.responses import chat_response\n"
        "loaded = [m for m in ('fastapi', 'starlette', 'phloem.entrypoints.openai.server')\n"
        "          if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
