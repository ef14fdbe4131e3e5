"""Saved state: cursors and partition / mixture states, the sidecar codec, checkpoints, resume checks, relocation."""
