"""LLaMA-Factory's preference stages (dpo / rm: pairwise rows; kto: a ``kto_tag`` column) as our stream
(docs/llamafactory.md, "Preference stages"). kto pairs every row with the previous row's response within a
``map`` batch, so kto rows are processed in chunks of ``preprocessing_batch_size``, an unfinished chunk saved."""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError

# DatasetAttr fields of preference data (in the fingerprint only when set: pt / sft fingerprints stay as they were)
ATTR_FIELDS = ("ranking", "chosen", "rejected", "kto_tag")


def check_stage(attrs: dict[str, Any], stage: str) -> None:
    """As LLaMA-Factory's loader: pairwise (``ranking: true``) datasets for the rm stage (dpo, rm) only."""
    for attr in attrs.values():
        if bool(attr.ranking) != (stage == "rm"):
            allowed = "ranking: true (chosen / rejected)" if stage == "rm" else "datasets without ranking: true"
            raise ConfigError(f"dataset {attr.dataset_name!r} (dataset_info.json): got ranking: "
                              f"{str(bool(attr.ranking)).lower()} for a {'dpo / rm' if stage == 'rm' else stage} "
                              f"stage; allowed: {allowed}")
        if stage == "kto" and not attr.kto_tag:
            # every row would be dropped by the feedback processor (it needs a desirable / undesirable response)
            raise ConfigError(f"dataset {attr.dataset_name!r} (dataset_info.json): no kto_tag column for stage kto; "
                              "allowed: a dataset whose columns name kto_tag (a boolean: desirable or not)")


def fingerprint(attr) -> dict[str, Any]:
    return {f: getattr(attr, f) for f in ATTR_FIELDS if getattr(attr, f, None)}


def chunk(stage: str, data_args) -> int | None:
    """Rows processed together for a preference stage (None for the others)."""
    if stage == "kto":
        return max(1, int(data_args.preprocessing_batch_size))
    return 1 if stage == "rm" else None


def example_keys(stage: str, rows: list[tuple[str, dict]], n: int) -> list[list[str]] | None:
    """The sample key of each of the ``n`` examples of a kto chunk: the rows the feedback processor keeps, in order
    (it drops those its validity check drops, below). None for the other stages."""
    if stage != "kto":
        return None
    kept = [[key] for key, row in rows if len(row["_prompt"]) % 2 == 1 and len(row["_response"]) >= 2]
    if len(kept) != n:     # a LLaMA-Factory whose check differs: the chunk's keys on its first example
        return [[key for key, _ in rows]] + [[] for _ in range(n - 1)]
    return kept
