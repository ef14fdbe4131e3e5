"""Readers of data formats we index ourselves (one module per format)."""
