"""State files are parsed defensively: every number read from a manifest, a sidecar or a dataset index is
bounded before it sizes anything, an unknown format version and deeply nested or oversized JSON are named
errors, and `inspect` checks a checkpoint's saved index as a resume does. Each case exits 2 in seconds and
bounded memory (the huge ones run in a forked child with a capped address space)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resumable_stream import safe_io


# ------------------------------------------------------------------ the bounded JSON parser
def test_nesting_is_measured_outside_strings_only():
    depth = safe_io.json_depth
    assert depth(b"") == 0 and depth(b"1") == 0 and depth(b"[]") == 1 and depth(b'{"a": [[1], {"b": []}]}') == 4
    assert depth(b'["[[[{{{", "\\"[[[", "\\\\", [["]]]"]]]') == 3      # brackets and escaped quotes in strings
    assert depth(b'"\\\\\\"[[[["') == 0 and depth(b'["unterminated [[[') == 1
    for size in (1, 3, 7):     # a document cut anywhere between the chunks of the scan
        assert safe_io.json_depth(b'[["\\"]]"], [[]]]', chunk=size) == 3


_TEXT = st.text(alphabet='ab"\\[]{}é\n', max_size=6)
_JSON = st.recursive(st.none() | st.integers() | _TEXT, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=20)


def _nesting(value) -> int:
    if isinstance(value, (dict, list)):
        return 1 + max(map(_nesting, value.values() if isinstance(value, dict) else value), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(value=_JSON, chunk=st.sampled_from([1, 2, 5, 1 << 22]), ascii_only=st.booleans())
def test_the_nesting_of_any_json_document_is_measured_exactly(value, chunk, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert safe_io.json_depth(text.encode(), chunk=chunk) == _nesting(value)


def test_the_bounded_parser_reads_what_json_reads_up_to_the_depth_limit():
    doc = "[" * 64 + '"x \\" ]]"' + "]" * 64
    assert safe_io.parse_json(doc) == json.loads(doc) and safe_io.parse_json(doc.encode()) == json.loads(doc)
    for bad, needle in (("[" * 65 + "]" * 65, "nested 65 levels deep; allowed: at most 64"),
                        ('{"a": }', "not JSON"), (b"\xff[]", "not UTF-8")):
        with pytest.raises(safe_io.JSONRefused, match=needle):
            safe_io.parse_json(bad)
    assert issubclass(safe_io.JSONRefused, ValueError)
