"""LLaMA-Factory's own training, with its dataset replaced by a resumable stream.

    resumable-stream llamafactory train THEIR.yaml [key=value ...]
    FORCE_TORCHRUN=1 NPROC_PER_NODE=2 resumable-stream llamafactory train THEIR.yaml
    torchrun --nproc_per_node 2 -m resumable_stream llamafactory train THEIR.yaml

The yaml is the one ``llamafactory-cli train`` takes, plus an optional ``resumable_stream:`` section
(:mod:`.settings`). LLaMA-Factory runs its workflow (model loading, template, collator, callbacks, final
save, metrics, plots); only its ``get_dataset`` is replaced (:mod:`.data`): the datasets of
``dataset_info.json`` become our stream (one source, or a weighted mixture), and every row is formatted by
LLaMA-Factory's own converter and dataset processor inside the stream (:mod:`.processor`), so its template,
``cutoff_len``, ``train_on_prompt``, ``mask_history``, ``packing`` mean what they mean there and a resume is
exact. :mod:`resumable_stream.app.llamafactory` applies the patches and launches torchrun like
``llamafactory-cli``.

Only the command (app/llamafactory.py) imports it; it needs ``llamafactory`` (``pip install
'resumable-stream[llamafactory]'``).
"""
