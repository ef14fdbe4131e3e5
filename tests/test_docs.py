"""The README and every page of docs/ say only what the code accepts.

Each fenced block is checked against the real thing: yaml against the config validator (merged over a
shipped example config when it is a fragment), shell commands against the CLI parser, the Makefile, the
files they name and the package extras, Python blocks compiled with their ``resumable_stream`` imports
resolved; the CLI reference against the parser's options; every relative link and anchor against the files.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import io
import json
import os
import re
import shlex

import pytest
import yaml
from repo_paths import REPO_ROOT

from resumable_stream.app.cli import build_parser
from resumable_stream.config.stream_config import StreamConfig
from resumable_stream.config.trainer import TrainerConfig
from resumable_stream.errors import ConfigError

ROOT = REPO_ROOT
DOCS = os.path.join(ROOT, "docs")
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(DOCS) if f.endswith(".md"))
README_LIMIT_BYTES = 12 * 1024

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXAMPLES = {"text": "examples/tiny/train_lm.yaml", "messages": "examples/tiny/train_sft.yaml",
            "vl": "examples/tiny/train_vl.yaml"}


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _blocks(page: str, lang: str) -> list[tuple[int, str]]:
    """(line number, body) of every fenced block of ``lang`` in ``page``."""
    text = _read(page)
    return [(text[:m.start()].count("\n") + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == lang]


def _all_blocks(lang: str) -> list[tuple[str, int, str]]:
    return [(page, line, body) for page in PAGES for line, body in _blocks(page, lang)]


def _ids(blocks):
    return [f"{page}:{line}" for page, line, *_ in blocks]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: str) -> set[str]:
    text = FENCE.sub("", _read(page))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


# ------------------------------------------------------------------------------ structure and links

def _readme_section(title: str) -> str:
    return _read("README.md").split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_is_short_and_its_doc_table_links_every_docs_page_and_command():
    size = len(_read("README.md").encode())
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; the limit is {README_LIMIT_BYTES}"
    table = _readme_section("Documentation")
    linked = {os.path.normpath(t.partition("#")[0]) for t in LINK.findall(table)}
    missing = [p for p in PAGES[1:] if os.path.normpath(p) not in linked]
    assert not missing, f"docs pages the README's documentation table does not link: {missing}"
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    unnamed = [c for c in commands if f"`{c}`" not in table]
    assert not unnamed, f"commands the README's documentation table does not name: {unnamed}"


def test_readme_install_lists_every_extra():
    listed = set(re.findall(r"'\.\[([\w-]+)\]'", _readme_section("Install")))
    assert listed == _extras(), f"README lists {sorted(listed)}; pyproject.toml has {sorted(_extras())}"


def test_readme_quick_start_is_exactly_two_commands():
    text = _read("README.md")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    first_block = _blocks("README.md", "bash")[0][1]
    assert first_block in section
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"], commands


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    problems = []
    for target in LINK.findall(FENCE.sub("", _read(page))):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(ROOT, resolved)):
            problems.append(f"{target}: no file {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            problems.append(f"{target}: no heading #{anchor} in {resolved}")
    assert not problems, f"{page}: {problems}"


@pytest.mark.parametrize("page", PAGES)
def test_no_page_points_at_files_outside_the_repository(page):
    text = _read(page)
    for name in ("DESIGN.md", "the RFC"):
        assert name not in text, f"{page} refers to {name!r}, which is not in the repository"
    for path in re.findall(r"`((?:examples|benchmarks|tests|resumable_stream|docs)/[\w./-]+)`", text):
        if not any(c in path for c in "*{<"):
            assert os.path.exists(os.path.join(ROOT, path.split("::")[0])), f"{page} names {path}, which does not exist"


# ------------------------------------------------------------------------------ yaml

def _merged(block: dict) -> dict:
    """``block`` over the shipped example config of its format: a fragment (only some keys of data: /
    train:) is checked as part of a whole config."""
    if not ({"model", "data", "train"} & set(block)):
        block = {"data": block}     # a yaml that is only data keys
    data = block.get("data") or {}
    with open(os.path.join(ROOT, EXAMPLES.get(data.get("format", "text"), EXAMPLES["text"])),
              encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    if "sources" in data:
        for key in ("dataset_name_or_path", "name", "data_files"):
            doc["data"].pop(key, None)
    if "dataset_name_or_path" in data:
        doc["data"].pop("data_files", None)
    for section, values in block.items():
        if section == "model":
            doc["model"] = copy.deepcopy(values)    # a model section replaces the example's whole
        else:
            doc[section].update(copy.deepcopy(values))
    return doc


YAML_BLOCKS = _all_blocks("yaml")


def test_there_are_yaml_examples_to_check():
    assert len(YAML_BLOCKS) >= 6


def _write_file_blocks(root) -> list[str]:
    """Python blocks that open with ``# some/path.py`` are files the docs ask the user to write (e.g. the
    module a ``data.map`` names): write them under ``root``, so the yaml naming them is checked for real."""
    written = []
    for _, _, body in _all_blocks("python"):
        m = re.match(r"^# ([\w/]+\.py)\n", body)
        if m:
            path = os.path.join(root, m.group(1))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(body)
            written.append(m.group(1))
    return written


def _is_llamafactory_yaml(doc: dict) -> bool:
    """A llamafactory-cli yaml (docs/llamafactory.md, examples/llamafactory/): its own top-level keys."""
    return "stage" in doc or "model_name_or_path" in doc


def _check_llamafactory_yaml(doc: dict) -> None:
    """What `resumable-stream llamafactory train` checks before LLaMA-Factory runs: our section, the keys we
    refuse (LLaMA-Factory's own parser is not installed here; tests/against_llamafactory runs it)."""
    from resumable_stream.integrations.llamafactory import settings

    args, _ = settings.split(doc)
    settings.refuse_unsupported(args)


@pytest.mark.parametrize("page,line,body", YAML_BLOCKS, ids=_ids(YAML_BLOCKS))
def test_yaml_examples_pass_the_config_validator(page, line, body, tmp_path, monkeypatch):
    _write_file_blocks(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    block = yaml.safe_load(body)
    assert isinstance(block, dict), f"{page}:{line}: not a mapping"
    if _is_llamafactory_yaml(block):
        try:
            _check_llamafactory_yaml(block)
        except ConfigError as e:
            pytest.fail(f"{page}:{line}: resumable-stream llamafactory refuses this example: {e}")
        return
    try:
        TrainerConfig.from_dict(_merged(block), base_dir=os.path.join(ROOT, "examples", "tiny"))
    except ConfigError as e:
        pytest.fail(f"{page}:{line}: the config validator refuses this example: {e}")


def test_the_yaml_check_catches_a_wrong_key():
    """The check above is not vacuous: a misspelt key in a fragment is refused."""
    with pytest.raises(ConfigError, match="data.bufer_size"):
        TrainerConfig.from_dict(_merged({"data": {"bufer_size": 10}}), base_dir=os.path.join(ROOT, "examples", "tiny"))


# ------------------------------------------------------------------------------ shell commands

def _commands() -> list[tuple[str, int, list[str]]]:
    out = []
    for page, line, body in _all_blocks("bash"):
        for i, text in enumerate(body.splitlines()):
            text = re.split(r"\s#\s|^#", text, maxsplit=1)[0].strip()
            if not text:
                continue
            argv = shlex.split(text)
            while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):   # VAR=value prefixes
                argv.pop(0)
            out.append((page, line + 1 + i, argv))
    return out


COMMANDS = _commands()


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", _read("Makefile"), re.M))


def _extras() -> set[str]:
    section = _read("pyproject.toml").split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))    # tomllib is Python 3.11+


def _parse_cli(argv: list[str]) -> None:
    """The real parser, with abbreviations off: the docs spell options out in full."""
    parser = build_parser()
    for p in [parser, *next(a for a in parser._actions if a.dest == "command").choices.values()]:
        p.allow_abbrev = False
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        if e.code != 0:
            raise AssertionError(f"the CLI parser refuses {argv}: {err.getvalue().strip()}") from None


def _check_config_file(path: str) -> None:
    """A shipped config a command names must pass the validator."""
    full = os.path.join(ROOT, path)
    if path.startswith("examples/") and path.endswith(".yaml"):
        assert os.path.isfile(full), f"{path} does not exist"
        with open(full, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        if _is_llamafactory_yaml(doc):
            _check_llamafactory_yaml(doc)
            info = os.path.join(ROOT, doc["dataset_dir"], "dataset_info.json")
            with open(info, encoding="utf-8") as f:
                assert set(doc["dataset"].split(",")) <= set(json.load(f)), f"{path}: dataset not in {info}"
        elif "train" in doc:
            TrainerConfig.from_yaml(full)
        else:
            StreamConfig.from_yaml(full)


def check_command(argv: list[str]) -> None:
    """Raises AssertionError (or ConfigError) when a documented command would not work."""
    prog, args = argv[0], argv[1:]
    if prog == "make":
        assert set(args) <= _make_targets(), f"no Makefile target {sorted(set(args) - _make_targets())}"
    elif prog == "resumable-stream" or argv[:3] == ["python", "-m", "resumable_stream"]:
        args = args[2:] if prog == "python" else args
        _parse_cli(args)
        for a in args:
            _check_config_file(a)
    elif prog == "torchrun" and "-m" in args:         # torchrun ... -m resumable_stream ARGS: the CLI on each rank
        module, rest = args[args.index("-m") + 1], args[args.index("-m") + 2:]
        assert module == "resumable_stream", f"unknown module {module}"
        _parse_cli(rest)
        for a in rest:
            _check_config_file(a)
    elif prog in ("python", "torchrun"):
        scripts = [a for a in args if a.endswith(".py")]
        assert scripts, f"no script in {argv}"
        assert os.path.isfile(os.path.join(ROOT, scripts[0])), f"{scripts[0]} does not exist"
        for a in args[args.index(scripts[0]) + 1:]:
            _check_config_file(a)
    elif prog == "pip":
        for a in args:
            m = re.match(r"^\.\[([\w,]+)\]$", a)
            if m:
                unknown = set(m.group(1).split(",")) - _extras()
                assert not unknown, f"no extra {sorted(unknown)} in pyproject.toml"


def test_there_are_commands_to_check():
    progs = {argv[0] for _, _, argv in COMMANDS}
    assert {"make", "resumable-stream", "pip"} <= progs, progs


@pytest.mark.parametrize("page,line,argv", COMMANDS, ids=_ids(COMMANDS))
def test_documented_commands_are_accepted(page, line, argv):
    try:
        check_command(argv)
    except (AssertionError, ConfigError) as e:
        pytest.fail(f"{page}:{line}: {' '.join(argv)}: {e}")


@pytest.mark.parametrize("argv", [["resumable-stream", "warmup", "x.yaml", "--sample", "3"],
                                  ["resumable-stream", "inspect"],
                                  ["make", "no-such-target"],
                                  ["pip", "install", ".[nosuchextra]"],
                                  ["python", "examples/no_such_script.py"]])
def test_the_command_check_catches_a_wrong_command(argv):
    with pytest.raises(AssertionError):
        check_command(argv)


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def _cli_sections(text: str) -> dict[str, str]:
    """docs/cli.md's one-word ``## COMMAND`` sections: command -> its text (up to the next ``## ``)."""
    parts = re.split(r"^## (\S+)[ \t]*$", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ", 1)[0] for i in range(1, len(parts), 2)}


def _table_rows(section: str) -> list[list[str]]:
    """The cells of every table row of a section, outside its fenced blocks (``\\|`` is a | in a cell)."""
    rows = []
    for line in FENCE.sub("", section).splitlines():
        if line.startswith("|") and not re.match(r"^\|[-|\s]+\|$", line):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows[1:] if rows else rows       # less the header


def _option_strings(cell: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", cell))


def cli_table_problems(name: str, section: str, parser) -> list[str]:
    """What the section of command ``name`` gets wrong about ``parser``'s arguments: an option or positional
    argument missing from its table, an option the parser does not have, a default the parser does not use."""
    rows = _table_rows(section)
    first = {i: _option_strings(r[0]) for i, r in enumerate(rows)}
    problems = []
    known = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:                       # positional: by its metavar or name
            shown = action.metavar or action.dest.upper()
            if not any(f"`{shown}" in r[0] for r in rows):
                problems.append(f"argument {shown} not in the table")
            continue
        known |= set(action.option_strings)
        hits = [i for i, opts in first.items() if opts & set(action.option_strings)]
        if not hits:
            problems.append(f"option {'/'.join(action.option_strings)} not in the table")
        elif not set(action.option_strings) <= first[hits[0]]:
            problems.append(f"option {'/'.join(action.option_strings)}: the table names only "
                            f"{sorted(first[hits[0]])}")
        elif action.default not in (None, False) and str(action.default) not in rows[hits[0]][1]:
            problems.append(f"option {action.option_strings[-1]}: the parser's default is {action.default!r}, "
                            f"the table says {rows[hits[0]][1]!r}")
    stray = set().union(*first.values()) - known if first else set()
    problems += [f"option {o} in the table, not in the parser" for o in sorted(stray)]
    return problems


def test_cli_reference_has_a_section_per_command_and_no_other():
    sections = _cli_sections(_read("docs/cli.md"))
    assert set(sections) == set(_subcommands()), f"sections {sorted(sections)}, commands {sorted(_subcommands())}"


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_cli_reference_tables_every_argument_of_a_command_with_its_default(name):
    section = _cli_sections(_read("docs/cli.md")).get(name, "")
    problems = cli_table_problems(name, section, _subcommands()[name])
    assert not problems, f"docs/cli.md, ## {name}: {problems}"


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_cli_reference_shows_each_command_with_an_example_and_its_output(name):
    section = _cli_sections(_read("docs/cli.md")).get(name, "")
    fences = [(m.group(1), m.group(2)) for m in FENCE.finditer(section)]
    synopsis = [body for lang, body in fences if lang == "text" and body.startswith(f"resumable-stream {name} ")]
    assert synopsis, f"## {name}: no synopsis block (```text, starting 'resumable-stream {name} ')"
    known = set().union(*(a.option_strings for a in _subcommands()[name]._actions))
    assert _option_strings(synopsis[0].replace(f"resumable-stream {name}", "")) <= known, synopsis[0]
    example = next((i for i, (lang, body) in enumerate(fences)
                    if lang == "bash" and re.search(rf"^resumable-stream {name}\b", body, re.M)), None)
    assert example is not None, f"## {name}: no ```bash example running resumable-stream {name}"
    assert any(lang == "text" and body.strip() for lang, body in fences[example + 1:]), \
        f"## {name}: no ```text block with the example's output after it"


def test_cli_reference_peek_example_prints_what_the_page_shows(tmp_path, monkeypatch, capsys):
    """The peek example's output on the page is peek's: the same samples, the state saved and resumed."""
    from resumable_stream.app.cli import main

    section = _cli_sections(_read("docs/cli.md"))["peek"]
    fences = [(m.group(1), m.group(2)) for m in FENCE.finditer(section)]
    i = next(i for i, (lang, body) in enumerate(fences) if lang == "bash")
    commands = [shlex.split(line) for line in fences[i][1].splitlines() if line.strip()]
    shown = [group.splitlines() for group in fences[i + 1][1].strip().split("\n\n")]
    assert len(commands) == len(shown) == 3
    monkeypatch.chdir(tmp_path)            # runs/peek-state is written here
    for argv, lines in zip(commands, shown):
        argv = [os.path.join(ROOT, a) if a.startswith("examples/") else a for a in argv]
        assert main(argv[1:]) == 0
        out, err = capsys.readouterr()
        assert out.splitlines() == [x for x in lines if not x.startswith(('{"stats"', "saved "))]
        assert [x for x in err.splitlines() if x.startswith("saved ")] == [x for x in lines if x.startswith("saved ")]


def test_the_cli_table_check_catches_a_missing_option_a_stray_one_and_a_wrong_default():
    peek = _subcommands()["peek"]
    good = _cli_sections(_read("docs/cli.md"))["peek"]
    assert cli_table_problems("peek", good, peek) == []
    bad = good.replace("| `--stats` |", "| `--statz` |").replace("| `--num N` | 10 |", "| `--num N` | 20 |")
    bad = bad.replace("| `--fields a,b` |", "| `--columns a,b` |").replace("| `CONFIG` |", "| config |")
    assert cli_table_problems("peek", bad, peek) == [
        "argument CONFIG not in the table",
        "option --num: the parser's default is 10, the table says '20'",
        "option --fields not in the table",
        "option --stats not in the table",
        "option --columns in the table, not in the parser",
        "option --statz in the table, not in the parser"]


def test_cli_reference_documents_the_global_options():
    text = _read("docs/cli.md")
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert any(f"resumable-stream {o}" in text for o in action.option_strings), action.option_strings


# ------------------------------------------------------------------------------ python

PY_BLOCKS = _all_blocks("python")


@pytest.mark.parametrize("page,line,body", PY_BLOCKS, ids=_ids(PY_BLOCKS))
def test_python_examples_compile_and_their_imports_exist(page, line, body):
    tree = ast.parse(body, filename=f"{page}:{line}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("resumable_stream"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{page}:{line}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("resumable_stream"):
                    importlib.import_module(alias.name)


# Every name the prose shows (inline `from resumable_stream.x import y`, or a dotted `resumable_stream.x.y`) still
# imports: the house moved modules, and docs must not point at a name that is gone.
_INLINE_IMPORT = re.compile(r"from (resumable_stream[\w.]*) import ([\w, ]+)")
_DOTTED = re.compile(r"\bresumable_stream(?:\.\w+)+")


def _named_in_prose() -> list[tuple[str, str, tuple[str, ...]]]:
    found = []
    for page in PAGES:
        text = _read(page)
        for m in _INLINE_IMPORT.finditer(text):
            found.append((page, m.group(1), tuple(n.strip() for n in m.group(2).split(",") if n.strip())))
        for m in _DOTTED.finditer(text):
            found.append((page, m.group(0), ()))
    return sorted(set(found))


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module, or a name reached from the longest module prefix of it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


NAMED = _named_in_prose()


def test_there_are_names_in_prose_to_check():
    assert len(NAMED) > 20, NAMED


@pytest.mark.parametrize("page,dotted,names", NAMED, ids=[f"{p}:{d}" for p, d, _ in NAMED])
def test_every_name_the_docs_show_imports(page, dotted, names):
    assert _resolves(dotted), f"{page}: {dotted} does not import"
    for name in names:
        assert _resolves(f"{dotted}.{name}"), f"{page}: from {dotted} import {name} fails"


def test_the_name_check_catches_a_missing_name():
    assert _resolves("resumable_stream.state.checkpoint.save")
    assert not _resolves("resumable_stream.state.checkpoint.no_such_name")
    assert not _resolves("resumable_stream.no_such_module")


# docs/trainers.md: every Python snippet is an excerpt (its lines, in order, whatever their indentation) of a file a
# test runs, so what the page shows is what is tested
TRAINER_SNIPPET_SOURCES = ("examples/own_trainer.py", "examples/torch_loop.py",
                           "tests/_support/trainer_checkpoints_train.py", "examples/train_lm_mindspore.py")


def _is_excerpt(body: str, source: str) -> bool:
    want = [line.strip() for line in body.splitlines() if line.strip()]
    have = [line.strip() for line in source.splitlines()]
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def test_every_snippet_of_the_trainers_page_is_an_excerpt_of_a_tested_file():
    sources = {name: _read(name) for name in TRAINER_SNIPPET_SOURCES}
    blocks = [(line, body) for page, line, body in PY_BLOCKS if page == "docs/trainers.md"]
    assert len(blocks) >= 12, blocks
    for line, body in blocks:
        assert any(_is_excerpt(body, text) for text in sources.values()), \
            f"docs/trainers.md:{line}: not an excerpt of {', '.join(TRAINER_SNIPPET_SOURCES)}:\n{body}"
    assert not _is_excerpt("loader = StreamLoader(stream, BATCH)", sources["examples/torch_loop.py"])
