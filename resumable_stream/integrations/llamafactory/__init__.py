"""LLaMA-Factory's own training, with its ``get_dataset`` replaced by a resumable stream (docs/llamafactory.md):
``resumable-stream llamafactory train THEIR.yaml [key=value ...]``. Every row is formatted by LLaMA-Factory's
converter and dataset processor inside the stream (:mod:`.processor`), so its template and options mean what
they mean there and a resume is exact. Only :mod:`resumable_stream.app.llamafactory` imports it."""
