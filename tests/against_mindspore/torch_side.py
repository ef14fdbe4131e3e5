"""The PyTorch side of tests/against_mindspore/test_cross_framework.py, run in a venv with torch:
    torch_side.py OUT.json N [--load STATE_DIR] [--skip K --save STATE_DIR]
reads N batches through a StreamLoader (torch collate) after loading STATE_DIR, or reads K, saves, reads N."""

import argparse
import sys

import ms_helpers

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("n", type=int)
    ap.add_argument("--load")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--save")
    args = ap.parse_args()
    loader = ms_helpers.torch_loader()
    assert "torch" in sys.modules
    if args.load:
        loader.load_sidecar(args.load)
    if args.skip:
        ms_helpers.take(loader, args.skip)
        loader.save_sidecar(args.save)
        loader.pop_consumed_keys()
    ms_helpers.dump(args.out, {"batches": ms_helpers.take(loader, args.n), "keys": loader.pop_consumed_keys()})
