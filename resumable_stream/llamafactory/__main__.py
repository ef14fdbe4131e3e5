"""``python -m resumable_stream.llamafactory train CONFIG [key=value ...]``: what each torchrun rank runs."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["llamafactory", *sys.argv[1:]]))
