"""``python -m resumable_stream ...`` is the ``resumable-stream`` command."""

import sys

from .app.cli import main

if __name__ == "__main__":
    sys.exit(main())
