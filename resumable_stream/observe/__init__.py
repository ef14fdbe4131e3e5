"""Counters and views of the data path: metrics, progress, the data-bound watch, Prometheus."""
