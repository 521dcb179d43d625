"""The deployment files (deploy/Dockerfile.plugin, deploy/Dockerfile.patched, deploy/kubernetes/pd-example.yaml,
docs/deploy.md) against the code they name, so that neither drifts silently:

- every ``sglang-harden`` invocation names a subcommand, options and values the CLI has
  (``sglang_harden.cli.build_parser``); complete ones (Dockerfile commands, fenced blocks) parse whole;
- every ``SGLANG_HARDEN_*`` name is a setting (``sglang_harden.config.setting_names()``), every ``--harden-*``
  flag a ``HardenConfig`` field, every ``--ignore`` an audit finding code;
- the Dockerfiles' default image is a supported pin, the patched one's pin has a series;
- the Kubernetes example parses (a small parser for the block-style YAML subset it is kept in, which needs no
  PyYAML; compared with PyYAML where that is importable) and mounts the secret read-only at mode 0400.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from sglang_harden import cli
from sglang_harden.compat.pins import PATCHED_TREE_MARKER, SUPPORTED_PINS
from sglang_harden.config import TESTBED_PREFIX, HardenConfig, setting_names
from sglang_harden.tools.audit import FINDING_CODES
from sglang_harden.tools.patch import available_pins

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DOCKERFILE = ROOT / "deploy" / "Dockerfile.plugin"
PATCHED_DOCKERFILE = ROOT / "deploy" / "Dockerfile.patched"
K8S_EXAMPLE = ROOT / "deploy" / "kubernetes" / "pd-example.yaml"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
DOCKERFILES = (PLUGIN_DOCKERFILE, PATCHED_DOCKERFILE)
ALL_FILES = (*DOCKERFILES, K8S_EXAMPLE, DEPLOY_DOC)
LAUNCHER = ["python3", "-m", "sglang_harden.launch_server"]
WHEEL_PATCHES = "sglang_harden/_patches"


# ---------------------------------------------------------------- where the files say `sglang-harden ...`


def _code_spans(text: str) -> list[str]:
    """Inline `code` spans and fenced blocks of Markdown (or of comments)."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    return fenced + re.findall(r"`([^`\n]+)`", rest)


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)


def _dockerfile_lines(path: Path) -> tuple[list[str], list[str]]:
    """(instruction lines, comment lines); continuation lines count as instruction lines."""
    code, comments = [], []
    for line in path.read_text().splitlines():
        (comments if line.lstrip().startswith("#") else code).append(line)
    return code, comments


# `sglang-harden` followed by blanks, not part of a longer name or a path (sglang-harden-plugin, 'sglang-harden')
INVOCATION_RE = re.compile(r"(?<![\w/.-])sglang-harden[ \t]+([^\n`;|&<>)\\]*)")
COMMAND_POSITION_RE = re.compile(r"(?:^|RUN|;|&&|\|\||\(|\{)\s*$")


def _invocations(text: str, complete: bool) -> list[tuple[list[str], bool]]:
    """Each invocation's argument tokens, and whether it stands where a shell runs it (then it must parse whole)."""
    out = []
    for match in INVOCATION_RE.finditer(text):
        tokens = [token.strip("\"'") for token in match.group(1).split()]
        before = text[: match.start()].rsplit("\n", 1)[-1]
        out.append(([t for t in tokens if t], complete and bool(COMMAND_POSITION_RE.search(before))))
    return out


def _all_invocations() -> list[tuple[str, list[str], bool]]:
    found = []
    for path in DOCKERFILES:
        code, comments = _dockerfile_lines(path)
        found += [(path.name, t, c) for t, c in _invocations("\n".join(code), complete=True)]
        for span in _code_spans("\n".join(comments)):
            found += [(path.name, t, False) for t, _ in _invocations(span, complete=False)]
    k8s_code = "\n".join(line for line in K8S_EXAMPLE.read_text().splitlines() if not line.lstrip().startswith("#"))
    found += [(K8S_EXAMPLE.name, t, False) for t, _ in _invocations(k8s_code, complete=False)]
    doc = DEPLOY_DOC.read_text()
    for block in _fenced_blocks(doc):
        found += [(DEPLOY_DOC.name, t, c) for t, c in _invocations(block, complete=True)]
    for span in _code_spans(re.sub(r"^```[^\n]*\n.*?^```", "", doc, flags=re.M | re.S)):
        found += [(DEPLOY_DOC.name, t, False) for t, _ in _invocations(span, complete=False)]
    return found


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser(command)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def _is_log_line(tokens: list[str]) -> bool:
    """``sglang-harden active: ...`` is the start-up line a doc quotes, not a command."""
    return bool(tokens) and tokens[0] == "active:"


def test_the_files_invoke_sglang_harden() -> None:
    """The extraction below finds what it must check (a broken pattern would check nothing)."""
    found = _all_invocations()
    commands = {tokens[0] for _f, tokens, _c in found if tokens and not _is_log_line(tokens)}
    assert {"--version", "doctor", "patch", "audit"} <= commands, commands
    assert sum(complete for _f, _t, complete in found) >= 5, found


def test_every_subcommand_option_and_value_exists_in_the_cli() -> None:
    top_level = {s for a in cli.build_parser(None)._actions for s in a.option_strings}
    problems = []
    for name, tokens, _complete in _all_invocations():
        if not tokens or _is_log_line(tokens):
            continue
        command = tokens[0]
        if command.startswith("-"):
            if command not in top_level:
                problems.append(f"{name}: sglang-harden {command}: no such option")
            continue
        if command not in cli.SUBCOMMANDS:
            problems.append(f"{name}: sglang-harden {command}: no such subcommand")
            continue
        options = _subparser(command)._option_string_actions
        positional = [a for a in _subparser(command)._actions if not a.option_strings and a.choices]
        if positional and len(tokens) > 1 and not tokens[1].startswith("-"):
            if tokens[1] not in positional[0].choices:
                problems.append(f"{name}: sglang-harden {command} {tokens[1]}: not one of {positional[0].choices}")
        for i, token in enumerate(tokens[1:], start=1):
            if not token.startswith("-") or token == "-":
                continue
            option = token.split("=", 1)[0]
            action = options.get(option)
            if action is None:
                problems.append(f"{name}: sglang-harden {command} {option}: no such option")
                continue
            value = token.split("=", 1)[1] if "=" in token else (tokens[i + 1] if i + 1 < len(tokens) else None)
            if action.choices and value is not None and value not in action.choices:
                problems.append(f"{name}: sglang-harden {command} {option} {value}: not one of {action.choices}")
    assert not problems, "\n".join(problems)


def test_complete_invocations_parse() -> None:
    problems = []
    for name, tokens, complete in _all_invocations():
        if not complete or tokens == ["--version"]:
            continue
        try:
            cli.build_parser(tokens[0]).parse_args(tokens)
        except SystemExit:
            problems.append(f"{name}: sglang-harden {' '.join(tokens)}")
    assert not problems, "these do not parse:\n" + "\n".join(problems)


# ---------------------------------------------------------------- names: settings, flags, finding codes


def test_every_sglang_harden_variable_is_a_setting() -> None:
    known = setting_names()
    unknown = set()
    for path in ALL_FILES:
        for match in re.finditer(r"SGLANG_HARDEN_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
            if not path.read_text()[match.end():].startswith("*"):
                unknown |= {f"{path.name}: {match.group(0)}"} if match.group(0) not in known else set()
    assert not unknown, sorted(unknown)


def test_every_harden_flag_is_a_config_field() -> None:
    names = {f.name for f in fields(HardenConfig)} - {"extra"}
    bad = {f"{p.name}: {m}" for p in ALL_FILES for m in re.findall(r"--harden-([a-z0-9-]+)", p.read_text())
           if m.replace("-", "_") not in names}
    assert not bad, sorted(bad)


def test_every_ignored_audit_finding_exists() -> None:
    codes = re.findall(r"--ignore[ =]([a-z_]+)", DEPLOY_DOC.read_text())
    assert codes and set(codes) <= set(FINDING_CODES), codes


# ---------------------------------------------------------------- what the files point to


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_repository_path_and_doc_link_exists() -> None:
    missing = []
    for path in ALL_FILES:
        for rel in re.findall(r"(?<![\w/.-])((?:sglang_harden|deploy|docs|tests|scripts|patches)/[\w./-]*\w)",
                              path.read_text()):
            if rel == WHEEL_PATCHES:  # in the wheel only: pyproject.toml copies patches/ there
                if f'"patches" = "{WHEEL_PATCHES}"' not in (ROOT / "pyproject.toml").read_text():
                    missing.append(f"{path.name}: {rel} (pyproject.toml no longer ships patches/ there)")
            elif not (ROOT / rel).exists():
                missing.append(f"{path.name}: {rel}")
    for target, anchor in re.findall(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)", DEPLOY_DOC.read_text()):
        linked = DEPLOY_DOC.parent / target
        if not linked.is_file():
            missing.append(f"{DEPLOY_DOC.name}: link {target}")
        elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}:
            missing.append(f"{DEPLOY_DOC.name}: link {target}#{anchor}")
    assert not missing, missing


def _series_settings(series_text: str) -> set[str]:
    """The ``SERIES_SETTINGS`` literal of the series' ``pd_auth.py`` (names and ``ENV_*`` constants resolved)."""
    constants = dict(re.findall(r'^\+(ENV_\w+) = "(SGLANG_HARDEN_\w+)"$', series_text, re.M))
    block = re.search(r"^\+SERIES_SETTINGS = frozenset\(\{\n(.*?)^\+\}\)", series_text, re.M | re.S)
    assert block, "no SERIES_SETTINGS in the series' pd_auth.py"
    return {constants.get(item, item.strip('"')) for item in re.findall(r'"SGLANG_HARDEN_\w+"|ENV_\w+', block.group(1))}


def test_the_deploy_doc_names_exactly_the_variables_the_series_read() -> None:
    """The doc's list is each series' own list of what it reads, and every name the series' code reads is on it
    (the refusal of unknown names lets exactly these through, besides the plugin's own)."""
    listed = re.search(r"The series reads these variables and no others: (.+?)\. ", DEPLOY_DOC.read_text(), re.S)
    assert listed
    documented = set(re.findall(r"`(SGLANG_HARDEN_\w+)`", listed.group(1)))
    for series in sorted((ROOT / "patches").glob("*/series")):
        text = "".join(p.read_text() for p in series.parent.glob("*.patch"))
        assert _series_settings(text) == documented, series.parent.name
        read = set(re.findall(r"SGLANG_HARDEN_[A-Z0-9]\w*[A-Z0-9]", text)) - {TESTBED_PREFIX.rstrip("_")}
        assert read <= documented, (series.parent.name, read - documented)


# ---------------------------------------------------------------- pins


def _default_arg(path: Path, name: str) -> str:
    found = re.search(rf"^ARG {name}=(\S+)$", path.read_text(), re.M)
    assert found, f"{path.name}: no ARG {name}=<default>"
    return found.group(1)


def _image_release(image: str) -> str:
    found = re.fullmatch(r"lmsysorg/sglang:v(\d+\.\d+\.\d+(?:\.post\d+)?)(?:-\S+)?", image)
    assert found, f"{image}: not an official lmsysorg/sglang:v<release>[-variant] image"
    return found.group(1)


def test_the_plugin_image_defaults_to_a_supported_pin() -> None:
    assert _image_release(_default_arg(PLUGIN_DOCKERFILE, "SGLANG_IMAGE")) in SUPPORTED_PINS
    assert "FROM ${SGLANG_IMAGE}" in PLUGIN_DOCKERFILE.read_text()


def test_the_patched_image_defaults_to_a_pin_with_a_series_and_its_image() -> None:
    pin = _default_arg(PATCHED_DOCKERFILE, "SGLANG_PIN")
    assert pin in available_pins(ROOT / "patches")
    assert _image_release(_default_arg(PATCHED_DOCKERFILE, "SGLANG_IMAGE")) == pin
    text = PATCHED_DOCKERFILE.read_text()
    assert text.count("FROM ${SGLANG_IMAGE}") == 2  # the builder and the final stage: the same official image
    assert "/".join(PATCHED_TREE_MARKER) in text  # the final stage checks for the series' marker file


def test_the_deploy_doc_lists_the_pins_the_code_has() -> None:
    doc = DEPLOY_DOC.read_text()
    plugin = re.search(r"^Supported pins \(plugin\): (.+)\.$", doc, re.M)
    series = re.search(r"^Backport series: (.+)\.$", doc, re.M)
    assert plugin and series
    assert plugin.group(1).split(", ") == list(SUPPORTED_PINS)
    assert sorted(series.group(1).split(", ")) == sorted(available_pins(ROOT / "patches"))


# ---------------------------------------------------------------- the Kubernetes example


class YamlSubsetError(ValueError):
    pass


_INT_RE = re.compile(r"[-+]?(0|[1-9][0-9_]*)")
_OCTAL_RE = re.compile(r"[-+]?0[0-7_]+")
_BOOLS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


def _scalar(text: str) -> Any:
    """A plain or quoted scalar, resolved as PyYAML's safe loader (YAML 1.1) resolves the forms used here."""
    if text[:1] in "\"'":
        if len(text) < 2 or text[-1] != text[0]:
            raise YamlSubsetError(f"unterminated quoted scalar {text!r}")
        body = text[1:-1]
        if text[0] == "'":
            return body.replace("''", "'")
        if "\\" in body:
            raise YamlSubsetError(f"escapes are outside the subset: {text!r}")
        return body
    if text[:1] in "{[|>&*!%@`" or text.startswith(("- ", "? ")):
        raise YamlSubsetError(f"outside the block-style subset: {text!r}")
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text.lower() in _BOOLS:
        return _BOOLS[text.lower()]
    if _OCTAL_RE.fullmatch(text):
        return int(text.replace("_", ""), 8)
    if _INT_RE.fullmatch(text):
        return int(text.replace("_", ""))
    if re.fullmatch(r"[-+]?(\d[\d_]*)?\.\d+([eE][-+]?\d+)?|[-+]?\d[\d_]*(:[0-5]?\d)+", text):
        raise YamlSubsetError(f"floats and base-60 numbers are outside the subset: {text!r}")
    return text


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'" and (i == 0 or line[i - 1] in " :-"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def parse_yaml_subset(text: str) -> list[Any]:
    """Block mappings, block sequences and scalars, ``---`` between documents: the subset pd-example.yaml keeps
    to. Anything else (flow collections, block scalars, anchors, tags) raises YamlSubsetError."""
    documents: list[list[tuple[int, str]]] = [[]]
    for raw in text.splitlines():
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise YamlSubsetError(f"tab in indentation: {raw!r}")
        line = _strip_comment(raw)
        if not line.strip():
            continue
        if line == "---":
            documents.append([])
            continue
        documents[-1].append((len(line) - len(line.lstrip(" ")), line.strip()))
    return [_block(lines, 0, lines[0][0])[0] for lines in documents if lines]


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    if lines[i][1].startswith("- ") or lines[i][1] == "-":
        return _sequence(lines, i, indent)
    return _mapping(lines, i, indent)


def _sequence(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    while i < len(lines) and lines[i][0] == indent and (lines[i][1].startswith("- ") or lines[i][1] == "-"):
        rest = lines[i][1][2:].strip()
        if not rest:
            value, i = _block(lines, i + 1, lines[i + 1][0])
        elif re.match(r"[^\"'\s][^:]*:(\s|$)", rest):
            # "- key: value": a mapping whose first entry sits on the dash line, the others at indent + 2
            lines = [*lines[:i], (indent + 2, rest), *lines[i + 1:]]
            value, i = _mapping(lines, i, indent + 2)
        else:
            value, i = _scalar(rest), i + 1
        out.append(value)
    if i < len(lines) and lines[i][0] > indent:
        raise YamlSubsetError(f"unexpected indentation at {lines[i][1]!r}")
    return out, i


def _mapping(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent:
        found = re.fullmatch(r"([^\"'\s#][^:]*?):(?:\s+(.*))?", lines[i][1])
        if found is None:
            raise YamlSubsetError(f"not a mapping entry: {lines[i][1]!r}")
        key, rest = found.group(1), (found.group(2) or "").strip()
        if key in out:
            raise YamlSubsetError(f"duplicate key {key!r}")
        if rest:
            out[key], i = _scalar(rest), i + 1
        elif i + 1 < len(lines) and (lines[i + 1][0] > indent or (
                lines[i + 1][0] == indent and lines[i + 1][1].startswith("- "))):
            out[key], i = _block(lines, i + 1, lines[i + 1][0])
        else:
            out[key], i = None, i + 1
    if i < len(lines) and lines[i][0] > indent:
        raise YamlSubsetError(f"unexpected indentation at {lines[i][1]!r}")
    return out, i


def _documents() -> list[dict[str, Any]]:
    return parse_yaml_subset(K8S_EXAMPLE.read_text())


def test_the_subset_parser_reads_yaml_as_pyyaml_does() -> None:
    sample = ("a: 1\nb: '0400'\nc: 0400\nd:\n- x\n- k: v\n  j: \"w\"\ne:\n  f: true # comment\n  g: 0.0.0.0\n"
              "---\nh: null\n")
    assert parse_yaml_subset(sample) == [
        {"a": 1, "b": "0400", "c": 256, "d": ["x", {"k": "v", "j": "w"}], "e": {"f": True, "g": "0.0.0.0"}},
        {"h": None},
    ]
    for outside in ("a: {b: 1}\n", "a: [1]\n", "a: |\n  x\n", "a: &x 1\n", "a: 1.5\n", "a: 1\n a2: 2\n"):
        with pytest.raises(YamlSubsetError):
            parse_yaml_subset(outside)


def test_the_example_parses_and_agrees_with_pyyaml_where_importable() -> None:
    documents = _documents()
    assert [d["kind"] for d in documents] == ["ConfigMap", "Service", "Deployment", "Service", "Deployment"]
    try:
        import yaml
    except ImportError:  # the subset parser above still checked the file; PyYAML only cross-checks it
        return
    assert [d for d in yaml.safe_load_all(K8S_EXAMPLE.read_text()) if d is not None] == documents


def _deployments() -> dict[str, dict[str, Any]]:
    out = {}
    for doc in _documents():
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            args = container["args"]
            out[args[args.index("--disaggregation-mode") + 1]] = doc
    return out


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def test_a_prefill_and_a_decode_deployment_run_the_launcher() -> None:
    deployments = _deployments()
    assert set(deployments) == {"prefill", "decode"}
    for deployment in deployments.values():
        container = _container(deployment)
        assert container["command"] == LAUNCHER
        assert all(isinstance(a, str) for a in container["command"] + container["args"])  # Kubernetes wants strings
        assert "--model-path" in container["args"] and "--enable-metrics" in container["args"]
        assert "nvidia.com/gpu" in container["resources"]["limits"]


def test_the_secret_is_mounted_read_only_at_mode_0400_and_named_by_its_variable() -> None:
    for role, deployment in _deployments().items():
        container = _container(deployment)
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        secret_volumes = [v for v in volumes.values() if "secret" in v]
        assert len(secret_volumes) == 1, role
        volume = secret_volumes[0]
        assert volume["secret"]["defaultMode"] == 0o400 == 256, role
        assert volume["secret"]["secretName"], role
        mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] is True, role
        assert "subPath" not in mount, role  # a subPath mount is never updated: rotation would not reach the pod
        secret_file = _env(container)["SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE"]["value"]
        assert secret_file.startswith(mount["mountPath"].rstrip("/") + "/"), role
    assert "defaultMode: 0400" in K8S_EXAMPLE.read_text()


def test_the_mode_comes_from_a_configmap_and_starts_in_log() -> None:
    configmaps = {d["metadata"]["name"]: d for d in _documents() if d["kind"] == "ConfigMap"}
    for role, deployment in _deployments().items():
        ref = _env(_container(deployment))["SGLANG_HARDEN_MODE"]["valueFrom"]["configMapKeyRef"]
        assert configmaps[ref["name"]]["data"][ref["key"]] == "log", role


def test_readiness_and_liveness_probes() -> None:
    for role, deployment in _deployments().items():
        container = _container(deployment)
        assert container["readinessProbe"]["httpGet"]["path"] == "/health", role
        assert container["livenessProbe"]["httpGet"], role


def test_prefill_lists_the_service_name_decode_uses_for_its_bootstrap_server() -> None:
    prefill = _deployments()["prefill"]
    container = _container(prefill)
    port = container["args"][container["args"].index("--disaggregation-bootstrap-port") + 1]
    labels = prefill["spec"]["template"]["metadata"]["labels"]
    services = [d for d in _documents() if d["kind"] == "Service"
                and d["spec"]["selector"].items() <= labels.items()]
    assert len(services) == 1
    assert port in [str(p["port"]) for p in services[0]["spec"]["ports"]]
    authorities = _env(container)["SGLANG_HARDEN_BOOTSTRAP_AUTHORITIES"]["value"].split(",")
    assert f"{services[0]['metadata']['name']}:{port}" in authorities
