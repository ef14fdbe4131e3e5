"""``python -m resumable_stream.integrations.llamafactory train CONFIG [key=value ...]``: what each torchrun rank runs."""

import sys

from resumable_stream.app.cli import main  # absolute: it also runs as resumable_stream.llamafactory.__main__

if __name__ == "__main__":
    sys.exit(main(["llamafactory", *sys.argv[1:]]))
