"""Typed service settings, read from the environment and the command line.

Each service declares one `ServiceSettings` subclass. Values come, lowest
precedence first, from field defaults, `BACKPORT_<SERVICE>_<FIELD>` environment
variables, then `--field-name` command-line flags.
"""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from typing import Any, Self

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError


def check_redis_url(value: str | None) -> None:
    """A URL redis-py can connect by, checked when the settings are read: redis-py itself reads
    it only once the service has started (an engine: after loading its model)."""
    if value is None:
        return
    from redis.connection import parse_url  # the services that take no Redis URL skip the import

    try:
        parse_url(value)
    except ValueError as error:
        raise ValueError(f"not a Redis URL: {error}") from None


class SettingsError(ValueError):
    """A flag or environment value that does not validate; the message names where it came from."""


class ServiceSettings(BaseSettings):
    # No setting means infinity: "inf" as a timeout or backoff would wait forever or fail in int().
    model_config = SettingsConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one flag per field; unset flags leave the field to env and defaults."""
        for name, field in cls.model_fields.items():
            flag = "--" + name.replace("_", "-")
            help_text = field.description or ""
            if _is_bool(field.annotation):
                parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                    default=argparse.SUPPRESS, help=help_text)
            elif _is_list(field.annotation):
                parser.add_argument(flag, dest=name, action="append", default=argparse.SUPPRESS,
                                    help=help_text + " (repeatable)")
            else:
                parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> Self:
        """The settings from these flags and the environment; SettingsError names each bad value's
        flag or variable (pydantic's own error names only the field)."""
        given = {k: v for k, v in vars(namespace).items() if k in cls.model_fields}
        try:
            return cls(**given)
        except ValidationError as error:
            problems = [cls._describe_problem(problem, given) for problem in error.errors()]
            raise SettingsError("; ".join(problems)) from None
        except SourceError as error:
            # An environment value of a list field that is not JSON; pydantic-settings names
            # only the field, in its message.
            field = re.search(r'field "(\w+)"', str(error))
            if field is None:
                raise SettingsError(str(error)) from None
            variable = cls._variable(field.group(1))
            raise SettingsError(f"{variable}={os.environ.get(variable)!r}: not JSON "
                                f"({error.__cause__}); a list is written [\"a\", \"b\"]") from None

    @classmethod
    def _variable(cls, name: str) -> str:
        return (cls.model_config.get("env_prefix") or "") + name.upper()

    @classmethod
    def _describe_problem(cls, problem: Any, given: dict[str, object]) -> str:
        location, message = problem["loc"], problem["msg"]
        if not location or location[0] not in cls.model_fields:
            return message  # a check across fields (a model validator)
        name = str(location[0])
        flag = "--" + name.replace("_", "-")
        variable = cls._variable(name)
        if problem["type"] == "missing":
            return f"{flag} (or {variable}) is required"
        return f"{flag if name in given else variable}={problem.get('input')!r}: {message}"


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_bool(annotation: Any) -> bool:
    return _unwrap_optional(annotation) is bool


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(_unwrap_optional(annotation)) is list
