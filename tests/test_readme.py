"""The documents' facts about the code, read from the code.

README.md, benchmarks/README.md and ARCHITECTURE.md state facts a reader acts on: the plan
file's version, the CLI's verbs, every configuration key, files and commands, the layers.
Each test below reads the fact from the code and names the mismatch when they disagree.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_architecture import MAY_IMPORT

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "benchmarks" / "README.md"
ARCHITECTURE = ROOT / "ARCHITECTURE.md"
DOCS = (README, BENCHMARKS, ARCHITECTURE)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) per Markdown heading of any level, outside code blocks."""
    out: list[tuple[str, list[str]]] = [("", [])]
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            out.append((line.lstrip("#").strip(), []))
        else:
            out[-1][1].append(line)
    return [(h, "\n".join(body)) for h, body in out]


def _section(text: str, heading: str) -> str:
    """The body of the section titled ``heading`` and of its sub-sections."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"(#+) {re.escape(heading)}$", line)),
                 None)
    assert start is not None, f"README.md has no section {heading!r}"
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    end = next((j for j in range(start + 1, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[j])), len(lines))
    return "\n".join(lines[start + 1:end])


# -- the plan version ----------------------------------------------------------------------


def test_plan_version_is_the_codes():
    from ilp_planner.plan.data import PLAN_SCHEMA, PLAN_VERSION

    text = _text(README)
    versions = {int(v) for v in re.findall(r'"version":\s*(\d+)', text)}
    assert versions, "README.md names no plan version (\"version\": N)"
    assert versions == {PLAN_VERSION}, (
        f"README.md names plan version(s) {sorted(versions)}; ilp_planner.plan.data.PLAN_VERSION "
        f"is {PLAN_VERSION}")
    schemas = set(re.findall(r'"schema":\s*"([^"]+)"', text))
    assert schemas == {PLAN_SCHEMA}, f"README.md names plan schema {schemas}; the code writes {PLAN_SCHEMA!r}"


# -- the CLI verbs -------------------------------------------------------------------------


def _cli_verbs() -> set[str]:
    import argparse

    from ilp_planner.cli import build_parser

    parser = build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1, "ilp_planner.cli.build_parser() has no single sub-command group"
    return set(subs[0].choices)


def test_verbs_are_the_clis():
    listed = set(re.findall(r"^- `ilp-planner ([a-z-]+)", _section(_text(README), "Command line"),
                            re.M))
    verbs = _cli_verbs()
    assert not listed - verbs, f"README.md lists verbs the CLI lacks: {sorted(listed - verbs)}"
    assert not verbs - listed, f"README.md's Command line lacks verbs: {sorted(verbs - listed)}"


def test_every_ilp_planner_command_names_a_verb():
    verbs = _cli_verbs()
    for doc in (README, BENCHMARKS):
        used = set(re.findall(r"ilp-planner ([a-z][a-z-]*)", _text(doc)))
        unknown = used - verbs
        assert not unknown, f"{doc.name} runs `ilp-planner` with unknown verb(s) {sorted(unknown)}"



def _verb_options() -> dict[str, set[str]]:
    """Each verb's option strings, read from the CLI's own parser."""
    from ilp_planner.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "verb")
    return {verb: {o for act in p._actions for o in act.option_strings}
            for verb, p in sub.choices.items()}


def test_every_option_the_docs_pass_exists():
    """Every ``--option`` written after ``ilp-planner VERB`` in the docs (a code block line or
    an inline command) is one of that verb's options."""
    options = _verb_options()
    for doc in (README, BENCHMARKS):
        for verb, rest in re.findall(r"ilp-planner ([a-z][a-z-]*)([^`\n]*)", _text(doc)):
            unknown = {o for o in re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", rest)
                       if o not in options[verb]}
            assert not unknown, f"{doc.name}: `ilp-planner {verb}` has no option {sorted(unknown)}"


# -- the configuration reference -----------------------------------------------------------

_BASE = {
    "model": {"kind": "mlp", "dims": [8, 8], "batch": 4},
    "cluster": {"nodes": 1, "devices_per_node": 2, "memory_gib": 1, "peak_tflops": 1,
                "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 1},
                          "inter": {"latency_us": 1, "bandwidth_gbps": 1}}},
}


def _allowed(doc: dict, where: str) -> list[str]:
    """The keys the config reader allows at ``where``, read from its error on an unknown key."""
    from ilp_planner.errors import ConfigError
    from ilp_planner.inputs.config import parse_config

    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    message = str(info.value)
    match = re.search(r"allowed keys: (.*)$", message)
    assert match, f"probing {where}: expected an 'allowed keys' error, got {message!r}"
    return [k.strip() for k in match.group(1).split(",")]


def _with(path: list, value: object) -> dict:
    import copy

    doc = copy.deepcopy(_BASE)
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    node[path[-1]] = value
    return doc


_BOGUS = "no_such_key_for_the_readme_test"


def _schema_keys() -> set[str]:
    """Every key of the configuration, as dotted paths (``[]`` for list items, ``*`` for the
    link level and an example input's name), read by probing the reader with unknown keys."""
    from ilp_planner.inputs.config import MODEL_KINDS

    keys: set[str] = set()

    def probe(path: list, value: dict, prefix: str) -> list[str]:
        found = _allowed(_with(path, {**value, _BOGUS: 1}), prefix)
        keys.update(f"{prefix}.{k}" if prefix else k for k in found)
        return found

    keys.update(_allowed({**_BASE, _BOGUS: 1}, "top level"))
    for section in ("cluster", "training", "solver", "pipeline"):
        base = _BASE.get(section, {})
        probe([section], base, section)
    probe(["cluster", "links"], _BASE["cluster"]["links"], "cluster.links")
    probe(["cluster", "compute"], {"hbm_gbps": 1}, "cluster.compute")
    for level in ("intra", "inter"):
        found = _allowed(_with(["cluster", "links", level], {_BOGUS: 1}), f"cluster.links.{level}")
        keys.update(f"cluster.links.*.{k}" for k in found)
    probe(["training", "bytes_per_param"], {}, "training.bytes_per_param")
    for kind in MODEL_KINDS:
        model = {"kind": kind}
        if kind == "graph":
            model["ops"] = [{"name": "x", "kind": "input", "shape": [2]}]
        if kind == "torch":
            model.update(module="runtime.modules:GPT", example_inputs={"ids": {"shape": [2]}})
        probe(["model"], model, "model")
    ops = [{"name": "x", "kind": "input", "shape": [2], _BOGUS: 1}]
    keys.update(f"model.ops[].{k}" for k in
                _allowed(_with(["model"], {"kind": "graph", "ops": ops}), "model.ops[0]"))
    spec = {"kind": "torch", "module": "runtime.modules:GPT",
            "example_inputs": {"ids": {"shape": [2], _BOGUS: 1}}}
    keys.update(f"model.example_inputs.*.{k}" for k in
                _allowed(_with(["model"], spec), "model.example_inputs.ids"))
    return keys


def _reference_keys() -> set[str]:
    """Every key the README's Configuration reference documents: each backticked dotted path
    opening a bullet (``- `solver.gap` — …``, ``- `a`, `b` — …``)."""
    body = _section(_text(README), "Configuration reference")
    keys: set[str] = set()
    for line in body.splitlines():
        m = re.match(r"- ((?:`[^`]+`,?\s*)+)", line)
        if m:
            keys.update(re.findall(r"`([a-z_][a-z_.\[\]*]*)`", m.group(1)))
    # a bullet's inline mentions of sub-keys (``training.bytes_per_param.weight``) count too
    keys.update(re.findall(r"`(training\.bytes_per_param\.[a-z_]+)`", body))
    return keys


def test_config_reference_is_the_schema():
    schema, documented = _schema_keys(), _reference_keys()
    missing = sorted(schema - documented)
    extra = sorted(documented - schema)
    assert not missing, f"README.md's Configuration reference lacks schema keys: {missing}"
    assert not extra, f"README.md's Configuration reference names keys the schema lacks: {extra}"


def test_config_reference_choices():
    from ilp_planner.inputs.config import MODEL_KINDS
    from ilp_planner.inputs.options import FALLBACKS, MILPS, RECOMPUTE, SCHEDULES
    from ilp_planner.lowering.cost_model import OPTIMIZER_PRESETS

    body = _section(_text(README), "Configuration reference")

    def bullet(key: str) -> str:
        m = re.search(rf"^- `{re.escape(key)}` —(.*?)(?=^- |^#|\Z)", body, re.M | re.S)
        assert m, f"README.md's Configuration reference has no bullet for {key}"
        return m.group(1)

    for key, choices in (("model.kind", MODEL_KINDS), ("pipeline.schedule", SCHEDULES),
                         ("solver.fallback", FALLBACKS), ("solver.milp", MILPS),
                         ("solver.recompute", RECOMPUTE), ("training.optimizer", OPTIMIZER_PRESETS)):
        named = set(re.findall(r"`([a-z0-9_-]+)`", bullet(key)))
        missing = sorted(set(choices) - named)
        assert not missing, f"README.md: {key} lacks the choice(s) {missing} (the code has {list(choices)})"


# -- files, configs and commands -----------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_paths_exist(doc):
    text = _text(doc)
    paths = set(re.findall(r"(?<![\w./$-])((?:benchmarks|configs|examples|tests|runtime|formulations|"
                           r"ilp_planner)/[\w./-]*\w)", text))
    paths |= {m for m in re.findall(r"`([A-Z][A-Z_]*\.md)`", text)}
    paths |= {".ci/run"} & set(re.findall(r"\.ci/run", text))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_benchmark_scripts_named_exist():
    for doc in (README, BENCHMARKS):
        scripts = set(re.findall(r"python benchmarks/([\w-]+)\.py", _text(doc)))
        missing = sorted(s for s in scripts if not (ROOT / "benchmarks" / f"{s}.py").exists())
        assert not missing, f"{doc.name} runs benchmark scripts that do not exist: {missing}"


def test_every_benchmark_script_is_documented():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    named = set(re.findall(r"python benchmarks/([\w-]+)\.py", _text(BENCHMARKS)))
    assert not scripts - named, f"benchmarks/README.md gives no command for {sorted(scripts - named)}"


def _tables(body: str) -> list[int]:
    """Offsets (line numbers) where a Markdown table starts in ``body``, outside code blocks."""
    out, fenced, previous = [], False, False
    for i, line in enumerate(body.splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        table = not fenced and line.startswith("|")
        if table and not previous:
            out.append(i)
        previous = table
    return out


_COMMAND = {README: r"(ilp-planner [a-z]|python benchmarks/|python -m |torchrun )",
            BENCHMARKS: r"python benchmarks/[\w-]+\.py"}


@pytest.mark.parametrize("doc", (README, BENCHMARKS), ids=lambda p: p.name)
def test_every_table_follows_its_command(doc):
    wrong = []
    for heading, body in _sections(_text(doc)):
        lines = body.splitlines()
        for start in _tables(body):
            before = "\n".join(lines[:start])
            if not re.search(_COMMAND[doc], before):
                wrong.append(f"{heading!r}: {lines[start][:60]}")
    assert not wrong, f"{doc.name}: tables with no command before them in their section: {wrong}"


def test_benchmark_tables_say_when_and_where():
    wrong = []
    for heading, body in _sections(_text(BENCHMARKS)):
        if not _tables(body):
            continue
        if not re.search(r"20\d\d-\d\d-\d\d", body) or not re.search(r"commit `[0-9a-f]{7,40}`", body):
            wrong.append(heading)
    assert not wrong, f"benchmarks/README.md: sections with a table but no date and commit: {wrong}"


def test_readme_python_blocks_parse():
    blocks = re.findall(r"```python\n(.*?)```", _text(README), re.S)
    assert blocks, "README.md has no Python block"
    for i, block in enumerate(blocks):
        try:
            ast.parse(block)
        except SyntaxError as exc:
            pytest.fail(f"README.md Python block {i + 1} does not parse: {exc}")


def test_readme_api_names_exist():
    import ilp_planner

    used = set(re.findall(r"\bilp_planner\.([A-Za-z_]\w*)\(", _text(README)))
    missing = sorted(n for n in used if n not in ilp_planner.__all__)
    assert not missing, f"README.md calls ilp_planner.{missing}, not in ilp_planner.__all__"


# -- the architecture page -----------------------------------------------------------------


def test_architecture_names_every_unit():
    text = _text(ARCHITECTURE)
    named = set(re.findall(r"`([a-z_.]+)`", text))
    missing = sorted(u for u in MAY_IMPORT if u not in named)
    assert not missing, f"ARCHITECTURE.md does not name the unit(s) {missing} of MAY_IMPORT"


def test_architecture_layer_order_matches_may_import():
    """The units of the layer table appear in an order where no unit may import a later one."""
    rows = re.findall(r"^\| `([a-z_.]+)` \|", _text(ARCHITECTURE), re.M)
    order = [u for u in rows if u in MAY_IMPORT]
    wrong = [f"{a} may import {b}, listed above it" for i, a in enumerate(order)
             for b in order[i + 1:] if b in MAY_IMPORT[a]]
    assert not wrong, f"ARCHITECTURE.md's layer table is out of order: {wrong}"


def test_install_and_test_commands_are_ci_s():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme = _text(README)
    pins = set(re.findall(r'"torch==([\d.]+)"', ci))
    assert pins, ".ci/run pins no torch version"
    named = set(re.findall(r'"torch==([\d.]+)"', readme))
    assert named == pins, f"README.md pins torch {sorted(named)}; .ci/run pins {sorted(pins)}"
    line = next((ln for ln in readme.splitlines() if "torch==" in ln and "pip install -e" in ln), "")
    assert line.index("torch==") < line.index("pip install -e") if line else False, (
        "README.md's install line must install the torch pin before the package")
    test_cmd = re.findall(r"^(python -m pytest[^\n]*)$", ci, re.M)
    assert test_cmd and test_cmd[0] in readme, (
        f"README.md does not give .ci/run's test command {test_cmd}")


# -- the Python examples' imports ----------------------------------------------------------


def test_every_python_example_imports_what_it_names():
    """Each ``python`` code block's ``import`` and ``from … import`` statements run (a
    name moved to another module broke the API example's second line)."""
    blocks = re.findall(r"```python\n(.*?)```", _text(README), flags=re.S)
    assert blocks
    for block in blocks:
        for node in ast.parse(block).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), "README.md", "exec"), {})
