"""_step_shape before (the drafter of the commit before, saved first: git show f6b1f11:phloem/spec_decode/drafter.py > /tmp/drafter_before.py) and after, same run."""

import importlib.util
import random
import sys
import timeit

sys.path.insert(0, "benchmarks")
from spec_drafter_host import _requests

from phloem.spec_decode.drafter import _step_shape as after

spec = importlib.util.spec_from_file_location("before", "/tmp/drafter_before.py")
mod = importlib.util.module_from_spec(spec)
sys.modules["before"] = mod
spec.loader.exec_module(mod)
before = mod._step_shape
for n in (256, 2048):
    rs = _requests(n, 16, random.Random(0))
    assert before(rs, 8192) == after(rs, 8192) and before(rs, 100) == after(rs, 100)
    for name, f in (("before", before), ("after", after)):
        t = min(timeit.repeat(lambda f=f, rs=rs: f(rs, 8192), number=50, repeat=7)) / 50
        print(f"_step_shape {n} requests {name}: {t * 1e6:.0f} us")
