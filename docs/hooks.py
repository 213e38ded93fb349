"""MkDocs hooks: the generated reference pages, rendered from the code at build time.

A page asks for a generated section with a comment on a line of its own:

- ``<!-- generate: cli -->``: every ``tokenfeed-server`` subcommand, from the argparse
  parser that ``tokenfeed_server.cli.build_parser()`` returns (usage, description, and
  every argument with its environment twin, valid range and default);
- ``<!-- generate: settings -->``: the settings classes of ``tokenfeed_server.config``
  (every field: flag, environment variable, type, default, range, description);
- ``<!-- generate: http -->``: the HTTP API from the OpenAPI schema of a real server
  (``tokenfeed-server serve`` on an empty store, loopback, free ports, stopped at once);
  the schema itself is published as ``reference/openapi.json``.

Only public entry points are imported (``tokenfeed_server.cli`` and
``tokenfeed_server.config``); the HTTP schema comes from a running server, so it does not
depend on where the FastAPI app is built inside the package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import typing
import urllib.request
from functools import cache
from typing import Any

MARKER = re.compile(r"^<!-- generate: (?P<what>[a-z]+) -->$", re.MULTILINE)


# ---------------------------------------------------------------------------- mkdocs hooks


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each ``<!-- generate: X -->`` line by the section it names."""

    def render(match: re.Match[str]) -> str:
        what = match.group("what")
        if what not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: unknown generated section {what!r}")
        return GENERATORS[what]()

    return MARKER.sub(render, markdown)


def on_files(files: Any, config: Any) -> Any:
    """Publish the server's OpenAPI schema as ``reference/openapi.json``."""
    from mkdocs.structure.files import File

    content = json.dumps(openapi_schema(), indent=2, sort_keys=True) + "\n"
    files.append(File.generated(config, "reference/openapi.json", content=content))
    return files


# ---------------------------------------------------------------------------- helpers


def _cell(text: object) -> str:
    """Text fit for one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _code(text: object) -> str:
    return f"`{text}`" if text not in (None, "") else ""


# ---------------------------------------------------------------------------- CLI

# "description [ENV; valid range; default X]": the help text the settings layer writes
HELP_TAIL = re.compile(r"^(?P<text>.*?)\s*\[(?P<tail>[^\[\]]*)\]$", re.DOTALL)


def _split_help(help_text: str) -> tuple[str, str, str, str]:
    """(description, environment twin, valid values, default) of one argument's help."""
    text = help_text.replace("%%", "%")
    match = HELP_TAIL.match(text)
    if not match:
        return text, "", "", ""
    parts = [p.strip() for p in match.group("tail").split(";")]
    env = parts[0] if parts and re.fullmatch(r"[A-Z][A-Z0-9_]*", parts[0]) else ""
    rest = parts[1:] if env else parts
    default = ""
    if rest and rest[-1] == "required":
        default = rest.pop()
    elif rest and rest[-1].startswith("default "):
        default = rest.pop().removeprefix("default ")
    return match.group("text"), env, "; ".join(rest), default


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or action.dest.upper()
                name += f" {metavar}"
        else:
            name = str(action.metavar or action.dest)
            if action.nargs in ("*", "+"):
                name += " ..."
        text, env, valid, default = _split_help(action.help or "")
        if not default and action.default not in (None, argparse.SUPPRESS, False):
            default = str(action.default)
        rows.append(
            f"| {_code(name)} | {_cell(text)} | {_code(env)} | {_cell(valid)} | {_cell(default)} |"
        )
    return rows


def render_cli() -> str:
    """Markdown for every subcommand of ``tokenfeed-server``."""
    from tokenfeed_server.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps usage lines at the terminal's width
    parser = build_parser()
    parser.prog = "tokenfeed-server"
    out = [
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        _cell(parser.description or ""),
        "",
    ]
    subs = _subparsers(parser)
    assert subs is not None, "tokenfeed-server has no subcommands"
    summaries = {a.dest: a.help or "" for a in subs._choices_actions}
    out.append("| command | what it does |")
    out.append("| --- | --- |")
    for name in subs.choices:
        out.append(f"| [`{name}`](#{name}) | {_cell(summaries.get(name, ''))} |")
    out.append("")
    out.append("Global options: `-v`, `--verbose` (debug logging), before the command.")
    out.append("")
    for name, sub in subs.choices.items():
        out.append(f"## {name}")
        out.append("")
        out.append(_cell(sub.description or summaries.get(name, "")))
        out.append("")
        out.append("```text")
        out.append(sub.format_usage().strip())
        out.append("```")
        out.append("")
        rows = _argument_rows(sub)
        if rows:
            out.append("| argument | meaning | environment | valid | default |")
            out.append("| --- | --- | --- | --- | --- |")
            out.extend(rows)
            out.append("")
        if sub.epilog:
            out.append(_cell(sub.epilog))
            out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------- settings


def _type_name(kind: Any) -> str:
    """A readable name of a field's type: ``int``, ``str | None``, ``'local' | 'ray'``."""
    origin = typing.get_origin(kind)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(kind)[0])
    if origin is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(kind))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in typing.get_args(kind))
    if kind is type(None):
        return "None"
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).replace("typing.", "")


def _bounds(field: Any) -> str:
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                bounds.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(bounds)


def _fields(model: Any) -> list[tuple[str, Any, str, str, str]]:
    """(name, FieldInfo, flag, environment variable, valid values) of every leaf setting.

    ``tokenfeed_server.config.settings_of`` says it as ``--help`` does; without it (an
    older or newer settings layer), the names follow the documented rule.
    """
    from tokenfeed_server import config

    settings_of = getattr(config, "settings_of", None)
    if settings_of is not None:
        return [(s.name, s.field, s.flag, s.env, s.valid()) for s in settings_of(model)]
    prefix = getattr(model, "ENV_PREFIX", "TOKENFEED_")
    found = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        leaves = (
            kind.model_fields.items()
            if isinstance(kind, type) and hasattr(kind, "model_fields")
            else [(name, field)]
        )
        for sub, f in leaves:
            flag = "--" + sub.replace("_", "-")
            found.append((sub, f, flag, prefix + sub.upper(), _bounds(f)))
    return found


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if hasattr(value, "model_fields"):
        return "(see below)"
    return "none" if value is None else repr(value)


SETTINGS_MODELS = (
    ("ServerConfig", "serve"),
    ("PrepareSettings", "prepare"),
    ("GcSettings", "gc"),
)


def render_settings() -> str:
    """Markdown tables of every settings class in ``tokenfeed_server.config``."""
    from tokenfeed_server import config

    out = []
    for class_name, command in SETTINGS_MODELS:
        model = getattr(config, class_name)
        out.append(f"## `{class_name}`: `tokenfeed-server {command}`")
        out.append("")
        out.append(_cell((model.__doc__ or "").strip().split("\n\n")[0]))
        prefix = getattr(model, "ENV_PREFIX", None)
        if prefix:
            out.append(f"Environment variables start with `{prefix}`.")
        out.append("")
        out.append("| field | flag | environment | type | default | valid | description |")
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        for name, field, flag, env, valid in _fields(model):
            out.append(
                f"| `{name}` | `{flag}` | `{env}` | {_cell(_code(_type_name(field.annotation)))} "
                f"| {_cell(_code(_default(field)))} | {_cell(valid)} "
                f"| {_cell(field.description or '')} |"
            )
        out.append("")
        nested = [
            (name, field.annotation)
            for name, field in model.model_fields.items()
            if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields")
        ]
        for name, sub in nested:
            out.append(
                f"Fields of `{sub.__name__}` (`{class_name}.{name}`) are settings of their own "
                "above: " + _cell((sub.__doc__ or "").strip().split("\n\n")[0])
            )
            out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------- HTTP API


@cache
def openapi_schema() -> dict[str, Any]:
    """The OpenAPI schema of a real server on an empty store (started and stopped here)."""
    with tempfile.TemporaryDirectory(prefix="tokenfeed-docs-") as store:
        cmd = [
            sys.executable, "-m", "tokenfeed_server.cli", "serve", "--store", store,
            "--host", "127.0.0.1", "--zmq-port", "0", "--http-port", "0",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = _ready_line(proc, timeout=60.0)
            http = json.loads(line)["http"]
            with urllib.request.urlopen(http + "/openapi.json", timeout=30) as answer:
                schema: dict[str, Any] = json.load(answer)
                return schema
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def _ready_line(proc: subprocess.Popen[str], timeout: float) -> str:
    import selectors

    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = proc.stdout.readline()
                if line:
                    return line
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise RuntimeError(f"tokenfeed-server serve exited before ready:\n{err}")
    raise TimeoutError("tokenfeed-server serve was not ready within the timeout")


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(_schema_type(s) for s in schema["anyOf"])
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return _schema_type(schema["allOf"][0])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map of {_schema_type(schema['additionalProperties'])}"
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    return str(kind)


def render_http() -> str:
    """Markdown of every operation and schema of the server's OpenAPI document."""
    schema = openapi_schema()
    out = [
        f"Generated from the OpenAPI {schema.get('openapi', '')} schema of "
        f"`{schema['info']['title']}` {schema['info']['version']}; the schema itself: "
        "[openapi.json](openapi.json) (a server also serves it at `/openapi.json`).",
        "",
        "## Operations",
        "",
    ]
    for path, item in schema["paths"].items():
        for method, op in item.items():
            out.append(f"### `{method.upper()} {path}`")
            out.append("")
            if op.get("summary"):
                out.append(f"**{_cell(op['summary'])}.** {op.get('description', '')}".strip())
            elif op.get("description"):
                out.append(op["description"])
            out.append("")
            params = op.get("parameters", [])
            if params:
                out.append("| parameter | in | type | required | description |")
                out.append("| --- | --- | --- | --- | --- |")
                for p in params:
                    out.append(
                        f"| `{p['name']}` | {p['in']} | {_schema_type(p.get('schema', {}))} "
                        f"| {'yes' if p.get('required') else 'no'} "
                        f"| {_cell(p.get('description', ''))} |"
                    )
                out.append("")
            out.append("| status | meaning | body |")
            out.append("| --- | --- | --- |")
            for status, response in op.get("responses", {}).items():
                bodies = []
                for media, content in response.get("content", {}).items():
                    body = _schema_type(content.get("schema", {}))
                    bodies.append(f"`{media}`: {body}")
                out.append(
                    f"| {status} | {_cell(response.get('description', ''))} "
                    f"| {_cell('; '.join(bodies))} |"
                )
            out.append("")
    out.append("## Schemas")
    out.append("")
    for name, model in schema.get("components", {}).get("schemas", {}).items():
        out.append(f"### {name}")
        out.append("")
        if model.get("description"):
            out.append(_cell(model["description"]))
            out.append("")
        props = model.get("properties", {})
        required = set(model.get("required", []))
        if props:
            out.append("| field | type | required | description |")
            out.append("| --- | --- | --- | --- |")
            for field, spec in props.items():
                out.append(
                    f"| `{field}` | {_cell(_schema_type(spec))} "
                    f"| {'yes' if field in required else 'no'} "
                    f"| {_cell(spec.get('description', ''))} |"
                )
            out.append("")
    return "\n".join(out)


GENERATORS = {"cli": render_cli, "settings": render_settings, "http": render_http}


if __name__ == "__main__":  # print one section: python docs/hooks.py cli|settings|http
    print(GENERATORS[sys.argv[1]]())
