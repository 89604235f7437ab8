"""The command line's shared parts: click options made from a request's fields, and
errors mapped to exit codes.

A request (:mod:`swarmfd.request`) declares the options that set its fields.
:func:`request_options` adds them to a command, in field order; :func:`build_request`
makes the request from what click parsed; :func:`usage_errors` turns the request's
ValueError or TypeError into a usage error (exit 2). As in pip-tools' scripts, the
click layer parses, calls the library and maps errors to exit codes; it implements no
behaviour and checks nothing itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import Any, TypeVar

import click

from .request import OptionSpec, field_default, option_specs

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "build_request", "click_option",
           "request_options", "usage_errors"]

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def click_option(name: str, spec: OptionSpec, default: Any = None) -> Callable[[F], F]:
    """The click option of ``spec``, whose value click passes as ``name``."""
    kwargs: dict[str, Any] = {"help": spec.help, "metavar": spec.metavar,
                              "required": spec.required, "show_default": spec.show_default}
    if spec.multiple:
        kwargs["multiple"] = True
    elif spec.is_flag:
        kwargs.update(is_flag=True, flag_value=spec.flag_value, default=default)
    else:
        kwargs["type"] = click.Choice(spec.choices) if spec.choices else spec.type
        if not spec.required:  # a default, even None, would count as given
            kwargs["default"] = default
    return click.option(*spec.decls, name, **kwargs)


def request_options(cls: type) -> Callable[[F], F]:
    """Add the options of request class ``cls`` to a command (``--help`` lists them in
    the order of the fields)."""
    options = [click_option(f.name, spec, field_default(f)) for f, spec in option_specs(cls)]

    def decorate(func: F) -> F:
        for add in reversed(options):
            func = add(func)
        return func

    return decorate


def build_request(cls: Callable[..., R], params: Mapping[str, Any], **given: Any) -> R:
    """Request class ``cls`` from click's ``params`` (its options' values, by field
    name; option groups built the same way) and ``given`` (its other fields)."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if "group" in f.metadata:
            values[f.name] = build_request(f.metadata["group"], params)
        elif "option" in f.metadata:
            values[f.name] = params[f.name]
    return cls(**values, **given)


@contextlib.contextmanager
def usage_errors(ctx: click.Context) -> Iterator[None]:
    """A request's ValueError or TypeError (bad input) as a usage error: exit 2."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc), ctx) from None
