"""Bytes from disk and network: the one network policy, verified ranged reads, the Hub, safe files."""
