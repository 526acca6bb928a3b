#!/usr/bin/env python3
"""ctest entry for the OpenAI-client tests: exits 77 (ctest's SKIP_RETURN_CODE) when pytest or
the openai package is not installed, so a machine without them skips instead of failing."""
import importlib.util
import os
import sys

missing = [m for m in ("pytest", "openai") if importlib.util.find_spec(m) is None]
if missing:
    print("skipping: python packages not installed: " + ", ".join(missing) +
          " (python3 -m pip install openai pytest)")
    sys.exit(77)

import pytest  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", here] + sys.argv[1:]))
