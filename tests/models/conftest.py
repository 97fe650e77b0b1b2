"""Makes the helpers next to these tests (paged_harness) importable under any pytest import mode."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
