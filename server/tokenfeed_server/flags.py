"""How a settings model meets the command line and the environment (see
:mod:`tokenfeed_server.config`, which declares the models).

:func:`add_arguments` declares the flags of a model; :func:`load` merges flags >
environment > defaults and returns the model, validated; :func:`explain` turns a refusal
into one line naming the flag, its twin and the valid range. Nothing here knows a setting
by name: it is generic over any frozen pydantic model with :class:`Spelling` metadata.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

Model = TypeVar("Model", bound=BaseModel)

__all__ = [
    "Model",
    "Setting",
    "Spelling",
    "add_arguments",
    "explain",
    "load",
    "parse_size",
    "settings_of",
]


@dataclass(frozen=True)
class Spelling:
    """Field metadata: a flag or variable name other than the one the field's name gives."""

    flag: str | None = None
    env: str | None = None


def lowercase(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]i?[bB]|[bB])?\s*")
_SIZE_UNITS = {
    **{"": 1, "b": 1},
    **{u + "b": 1000 ** (i + 1) for i, u in enumerate("kmgt")},
    **{u + "ib": 1024 ** (i + 1) for i, u in enumerate("kmgt")},
}


def parse_size(text: str | int) -> int:
    """Bytes from ``123``, ``64MB`` (powers of 1000) or ``64MiB`` (powers of 1024).

    Raises ValueError naming the accepted forms.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0 bytes, got {text}")
        return text
    match = _SIZE_RE.fullmatch(str(text))
    if match is None:
        raise ValueError(
            f"{text!r} is not a size: give bytes, or a number with KB/MB/GB/TB (powers of "
            "1000) or KiB/MiB/GiB/TiB (powers of 1024), e.g. 20GiB"
        )
    number, unit = match.group(1), (match.group(2) or "").lower()
    if "." in number and unit in ("", "b"):
        raise ValueError(f"{text!r}: a number of bytes must be whole")
    return int(float(number) * _SIZE_UNITS[unit])


def as_path_text(value: object) -> object:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def as_size(value: object) -> object:
    return parse_size(value) if isinstance(value, str) else value


@dataclass(frozen=True)
class Setting:
    """One setting as the command line and the environment see it."""

    #: where the value goes in the model: ``("chunk_bytes",)``, ``("limits", "max_window")``
    path: tuple[str, ...]
    field: FieldInfo
    flag: str
    env: str

    @property
    def name(self) -> str:
        """The field's own name (also the argparse dest)."""
        return self.path[-1]

    @property
    def secret(self) -> bool:
        """Secrets (``repr=False``) are never echoed back in an error."""
        return not self.field.repr

    @property
    def switch(self) -> bool:
        """A boolean: a flag without a value (the environment says 1/0, true/false)."""
        return self.field.annotation is bool

    def metavar(self) -> str:
        """The value's placeholder in ``--help``: ``N``, ``PATH``, ``{debug,info,...}``."""
        kind = _without_none(self.field.annotation)
        if get_origin(kind) is Literal:
            return "{" + ",".join(str(v) for v in get_args(kind)) + "}"
        return {int: "N", float: "N", Path: "PATH"}.get(kind, self.name.upper())

    def valid(self) -> str:
        """What a valid value is, in words: ``an integer in 0..65535``."""
        return _valid(self.field)

    def help(self) -> str:
        """The ``--help`` text: the description, the twin, the range and the real default."""
        default = self.field.get_default(call_default_factory=True)
        if self.field.is_required():
            shown = "required"
        elif self.switch:
            shown = "default off"
        elif default is None:
            shown = "default none"
        else:
            shown = f"default {default}"
        rule = "" if self.switch else f"{self.valid()}; "
        text = f"{self.field.description} [{self.env}; {rule}{shown}]"
        return text.replace("%", "%%")


@functools.cache
def settings_of(model: type[BaseModel]) -> tuple[Setting, ...]:
    """Every setting of ``model``; a nested model's fields are settings of their own."""
    prefix: str = getattr(model, "ENV_PREFIX", "TOKENFEED_")
    found = []
    for path, field in _leaves(model):
        spelling = next((m for m in field.metadata if isinstance(m, Spelling)), Spelling())
        found.append(
            Setting(
                path=path,
                field=field,
                flag=spelling.flag or "--" + path[-1].replace("_", "-"),
                env=spelling.env or prefix + path[-1].upper(),
            )
        )
    return tuple(found)


def _leaves(model: type[BaseModel]) -> Iterator[tuple[tuple[str, ...], FieldInfo]]:
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for sub, subfield in kind.model_fields.items():
                yield (name, sub), subfield
        else:
            yield (name,), field


def add_arguments(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Declare one flag per setting of ``model``; an absent flag leaves no attribute."""
    for s in settings_of(model):
        common: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": s.help()}
        if s.switch:
            parser.add_argument(s.flag, action="store_true", **common)
        else:
            # the raw text goes to pydantic, so a flag and its twin are checked alike
            parser.add_argument(s.flag, metavar=s.metavar(), **common)


def load(model: type[Model], args: argparse.Namespace) -> Model:
    """``model`` from flags > ``TOKENFEED_*`` environment > defaults.

    Raises pydantic's ValidationError for a bad value; :func:`explain` says it in one line.
    """
    settings = settings_of(model)
    given = {s.env: getattr(args, s.name) for s in settings if hasattr(args, s.name)}
    merged = _sources(model)(**given)
    values: dict[str, Any] = {}
    for s in settings:
        node = values
        for part in s.path[:-1]:
            node = node.setdefault(part, {})
        node[s.name] = getattr(merged, s.name)
    return model.model_validate(values)


class _FlagsAndEnvironment(BaseSettings):
    """Values given at construction (the flags) beat the environment, which beats defaults."""

    model_config = SettingsConfigDict(
        frozen=True, extra="forbid", case_sensitive=True, env_ignore_empty=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # no .env file, no secrets directory: what is not a flag comes from the environment
        return init_settings, env_settings


@functools.cache
def _sources(model: type[BaseModel]) -> type[BaseSettings]:
    # One flat field per setting, named by its environment variable (the variable is the
    # validation alias, and flags are passed under the same key, so a flag replaces its twin).
    fields: dict[str, Any] = {
        s.name: (s.field.annotation, FieldInfo.merge_field_infos(s.field, validation_alias=s.env))
        for s in settings_of(model)
    }
    return create_model(f"{model.__name__}Sources", __base__=_FlagsAndEnvironment, **fields)


def explain(error: ValidationError, model: type[BaseModel]) -> str:
    """One line for the first problem: ``--chunk-bytes / TOKENFEED_CHUNK_BYTES: must be ...``."""
    by_key = {s.env: s for s in settings_of(model)} | {s.name: s for s in settings_of(model)}
    problems = error.errors()
    first = problems[0]
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    key = first["loc"][0] if first["loc"] else ""
    setting = by_key.get(str(key))
    if setting is None:  # a rule across settings; none is declared today
        return f"invalid settings: {first['msg']}{more}"
    where = f"{setting.flag} / {setting.env}"
    if first["type"] == "missing":
        return f"{where}: required (pass {setting.flag} or set {setting.env}){more}"
    got = "" if setting.secret else f" (got {_shown(first['input'])})"
    if first["type"] == "value_error":  # a rule of its own: its message says it
        return f"{where}: {str(first['msg']).removeprefix('Value error, ')}{got}{more}"
    return f"{where}: must be {setting.valid()}{got}{more}"


def _shown(value: object) -> str:
    if isinstance(value, str) and value and not any(c.isspace() for c in value):
        return value
    return repr(value)


def _without_none(kind: Any) -> Any:
    """``X`` for ``X | None`` (an optional setting is just absent), else ``kind``."""
    if get_origin(kind) in (Union, types.UnionType):
        return next(k for k in get_args(kind) if k is not type(None))
    return kind


def _valid(field: FieldInfo) -> str:
    kind = _without_none(field.annotation)
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(str(v) for v in get_args(kind))
    if kind is bool:
        return "true or false (1/0, yes/no, on/off)"
    noun = {int: "an integer", float: "a number", Path: "a path"}.get(kind, "a string")
    low = high = None
    words = []
    for rule in field.metadata:
        if isinstance(rule, annotated_types.Ge):
            low = rule.ge
            words.append(f">= {rule.ge}")
        elif isinstance(rule, annotated_types.Gt):
            words.append(f"> {rule.gt}")
        elif isinstance(rule, annotated_types.Le):
            high = rule.le
            words.append(f"<= {rule.le}")
        elif isinstance(rule, annotated_types.Lt):
            high = cast(int, rule.lt) - 1 if kind is int else None
            words.append(f"< {rule.lt}")
        elif isinstance(rule, annotated_types.MinLen):
            if rule.min_length == 1:
                noun = "a non-empty string"
            else:
                words.append(f"of at least {rule.min_length} characters")
    if kind is int and low is not None and high is not None:
        return f"an integer in {low}..{high}"
    return " ".join([noun, *words])
