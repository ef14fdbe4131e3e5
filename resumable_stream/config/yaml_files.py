"""Reading yaml (config files, ``key=value`` overrides) in bounded time and memory.

A config file is read only if it is a regular file of at most ``MAX_CONFIG_BYTES``, parsed with libyaml's C
loader where PyYAML has it (the same documents and errors as ``SafeLoader``). The node graph is checked before
any value is built: the nodes aliases add, counted as a walk meets them, at most ``MAX_ALIAS_NODES`` ("billion
laughs"); no alias inside its own node; at most ``MAX_YAML_DEPTH`` levels through aliases."""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml

from ..errors import ConfigError, shown

MAX_CONFIG_BYTES = 16 << 20     # 550,000 data files listed are 14.7 MiB
MAX_ALIAS_NODES = 1_000_000     # nodes aliases may add to a document (expanded, as a walk meets them)
MAX_YAML_DEPTH = 64             # the deepest real config nests ~6 levels

LOADER = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def read_config_text(path: str, what: str | None = None) -> str:
    """The text of the config file ``path``: a regular file of at most MAX_CONFIG_BYTES of UTF-8.
    ConfigError naming the file otherwise."""
    what = what or f"config file {shown(path)}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{what}: not found") from None
    except (OSError, ValueError) as e:    # ValueError: a NUL byte in the path
        raise ConfigError(f"{what}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, a device, a socket)"
            raise ConfigError(f"{what}: {kind}; allowed: a yaml file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{what}: {st.st_size} bytes; allowed: at most {MAX_CONFIG_BYTES} bytes (a config "
                              "file; list very many data files with a glob or a directory)")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:      # grew while being read
        raise ConfigError(f"{what}: over {MAX_CONFIG_BYTES} bytes; allowed: at most {MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: not UTF-8 text; expected a yaml file") from None


def load_file(path: str, what: str | None = None, loader: type = LOADER) -> Any:
    """The yaml document of the config file ``path`` (None when empty), read and checked as the module says."""
    what = what or f"config file {shown(path)}"
    return load_text(read_config_text(path, what), what, loader)


def load_text(text: str, what: str, loader: type = LOADER) -> Any:
    """The yaml document ``text`` (None when empty); ``what`` names it in errors (``config file 'x.yaml'``,
    ``override 'data.x=...'``)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what}: {len(text)} characters; allowed: at most {MAX_CONFIG_BYTES}")
    parser = loader(text)
    try:
        node = parser.get_single_node()
        if node is None:
            return None
        check_graph(node, what)
        return parser.construct_document(node)
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        raise ConfigError(f"{what}: not valid yaml ({_short(e)})") from None
    except (ValueError, OverflowError) as e:     # a scalar the constructor cannot convert (an int of 5000 digits)
        raise ConfigError(f"{what}: a value cannot be read ({_short(e)})") from None
    except RecursionError:                       # the pure-Python parser, nested too deep to parse
        raise ConfigError(f"{what}: nested too deep; allowed: at most {MAX_YAML_DEPTH} levels") from None
    finally:
        parser.dispose()


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) <= 400 else text[:397] + "..."


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_graph(root: yaml.Node, what: str) -> None:
    """Refuse a node graph whose aliases add more than MAX_ALIAS_NODES nodes, refer to a node that contains
    them, or nest it deeper than MAX_YAML_DEPTH (see the module doc). Iterative: one visit per distinct node."""
    expanded: dict[int, int] = {}     # id(node) -> nodes of its subtree as a walk meets them (capped)
    height: dict[int, int] = {}
    open_nodes: set[int] = set()      # the nodes on the path from the root: an alias to one of them is a cycle
    cap = MAX_ALIAS_NODES * 4
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    distinct = 0
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if closing:
            kids = _children(node)
            expanded[key] = min(cap, 1 + sum(expanded[id(k)] for k in kids))
            height[key] = 1 + max((height[id(k)] for k in kids), default=0)
            open_nodes.discard(key)
            if height[key] > MAX_YAML_DEPTH:
                raise ConfigError(f"{what}: nested more than {MAX_YAML_DEPTH} levels deep (counted through "
                                  f"aliases), at {_where(node)}; allowed: at most {MAX_YAML_DEPTH}")
            continue
        if key in expanded:
            continue
        if key in open_nodes:
            raise ConfigError(f"{what}: the node anchored at {_where(node)} holds an alias of itself (the value "
                              "would contain itself); allowed: aliases of nodes outside them")
        open_nodes.add(key)
        distinct += 1
        stack.append((node, True))
        stack.extend((kid, False) for kid in _children(node))
    added = expanded[id(root)] - distinct
    if added > MAX_ALIAS_NODES:
        raise ConfigError(f"{what}: its aliases expand its {distinct} nodes by "
                          f"{f'more than {MAX_ALIAS_NODES}' if expanded[id(root)] >= cap else added} nodes; allowed: "
                          f"aliases that add at most {MAX_ALIAS_NODES} nodes")


def _where(node: yaml.Node) -> str:
    mark = node.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a node"
