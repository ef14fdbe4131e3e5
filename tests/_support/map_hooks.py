"""``data.map`` functions for the tests (importable as ``map_hooks``: the tests directory is on sys.path)."""

from __future__ import annotations

NOT_CALLABLE = 3


def split_drop_rewrite(row: dict):
    """Drops every 5th id, splits every 3rd (other) row into three rows, upper-cases the text of the rest."""
    i = row["id"]
    if i % 5 == 0:
        return None
    if i % 3 == 0:
        words = row["text"].split()
        third = max(1, len(words) // 3)
        return [{"id": i, "text": " ".join(words[k * third:(k + 1) * third] or words)} for k in range(3)]
    return {"id": i, "text": row["text"].upper()}


def fails_on_seven(row: dict):
    if row["id"] == 7:
        raise ValueError("seven is not allowed")
    return row


def returns_a_number(row: dict):
    return 5


def alpaca_from_text(row: dict):
    """A text row as an alpaca one (for a mixture source that maps its rows into another format)."""
    return {"instruction": "Continue:", "input": row["text"][:20], "output": row["text"][20:] or "."}


def twice_unless_marked(row: dict):
    """Two copies of the row, none when it is marked ``drop``; raises on a row marked ``boom``."""
    if row.get("boom"):
        raise RuntimeError("boom")
    return None if row.get("drop") else [row, dict(row)]
