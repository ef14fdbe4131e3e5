"""Helper of test_sidecar_integrity: a save into one stream_state directory, SIGKILLed at random moments.

``python save_killer.py STATES_DIR STATE_DIR KILLS SEED`` reads the states ``STATES_DIR/<k>.safetensors``
(k = 0, 1, ...: one stream's state after k+1 samples). Each round forks a child that saves the states after
the last one the directory holds, one by one, as ``save_sidecar`` does for one rank (the rank file, then
the manifest); the parent SIGKILLs it a seeded random delay after its first complete save of the round (so
every round makes progress however loaded the machine is), then loads the directory and records which state
it holds (or the error). Prints one JSON line: ``{"loaded": [k or error, ...]}``.
"""

import json
import os
import random
import select
import signal
import sys
import time

from resumable_stream.errors import SidecarError
from resumable_stream.state import checkpoint as ckpt


def save_from(states: list[dict], first: int, state_dir: str, saved_fd: int) -> None:
    for state in states[first:]:
        ckpt.write_rank_file(state_dir, 0, state)
        ckpt.write_manifest(state_dir, 1)
        os.write(saved_fd, b".")            # one complete save more
    os._exit(0)


def loaded_index(state_dir: str, digests: list[tuple]) -> int | str:
    try:
        manifest = ckpt.read_manifest(state_dir)
        state, _ = ckpt.read_rank_state(state_dir, manifest, 0)
    except SidecarError as e:
        return f"error: {e}"
    ps = state["stream"]["partitions"][0]
    return digests.index((ps["consumed"], ps["next_sample_digest"], ps["consumed_digest"]))


def main() -> None:
    states_dir, state_dir, kills, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    states = [ckpt.read_state_file(os.path.join(states_dir, f"{k}.safetensors"))
              for k in range(len(os.listdir(states_dir)))]
    digests = [(s["stream"]["partitions"][0]["consumed"], s["stream"]["partitions"][0]["next_sample_digest"],
                s["stream"]["partitions"][0]["consumed_digest"]) for s in states]
    rng = random.Random(seed)
    ckpt.write_rank_file(state_dir, 0, states[0])     # the first complete save: from here on there is an old state
    ckpt.write_manifest(state_dir, 1)
    loaded, last = [], 0
    for _ in range(kills):
        saved_r, saved_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(saved_r)
            save_from(states, last + 1, state_dir, saved_w)
        os.close(saved_w)
        if not select.select([saved_r], [], [], 120)[0]:
            raise SystemExit("the saving child made no save in 120 s")
        time.sleep(rng.uniform(0.0, 0.04))       # then the kill lands anywhere in the saves that follow
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(saved_r)
        index = loaded_index(state_dir, digests)
        loaded.append(index)
        if isinstance(index, int):
            last = index
        if last + 1 >= len(states):
            break
    print(json.dumps({"loaded": loaded}))


if __name__ == "__main__":
    main()
