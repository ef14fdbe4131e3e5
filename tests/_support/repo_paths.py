"""Where things are, for the tests and the scripts they start (tests/_support is on sys.path: conftest.py)."""

import os

SUPPORT_DIR = os.path.dirname(os.path.abspath(__file__))   # tests/_support: servers, scripts, data builders
TESTS_DIR = os.path.dirname(SUPPORT_DIR)                    # tests/: one folder per package of resumable_stream
DATA_DIR = os.path.join(TESTS_DIR, "data")
REPO_ROOT = os.path.dirname(TESTS_DIR)
