"""The ``node`` command's options for the run spec's ``[node]`` settings, made from
``NodeSection``'s fields: each field's default, help, help panel and choices are written once,
there, and a setting added there is an option (and a ``SWARMGRAD_<SETTING>`` variable,
``config.resolve_settings``) with nothing else to edit.

An option left out is None: the environment's value, else the spec's, else the field's default
(what its help shows in brackets) holds.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Literal

import typer

from swarmgrad.node.runspec.operational import NodeSection

_TYPES: dict[str, type] = {"int": int, "str": str}


def setting_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per ``[node]`` setting, as typer reads a command's parameters."""
    parameters = []
    for setting in dataclasses.fields(NodeSection):
        meta = setting.metadata
        kind: Any = _TYPES[str(setting.type)]
        if meta["choices"]:
            kind = Literal[meta["choices"]]  # shown as <a|b|c>, and other values refused
        shown = setting.default if setting.default != "" else "unset"
        option = typer.Option(
            "--" + setting.name.replace("_", "-"),
            help=f"{meta['help']} \\[{shown}].",
            rich_help_panel=meta["panel"],
            show_default=False,
        )
        parameters.append(
            inspect.Parameter(
                setting.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[kind | None, option],
            )
        )
    return parameters


def with_settings(after: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A command that takes ``settings`` (a dict: setting -> value or None) as a typer command
    that takes each setting as an option of its own, listed after its parameter ``after`` (help
    panels come in the order their first option does)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(command, eval_str=True)
        kept = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in own.parameters.values()
            if p.name != "settings"
        ]
        made = setting_parameters()
        names = [p.name for p in made]
        cut = [p.name for p in kept].index(after) + 1

        @functools.wraps(command)
        def wrapper(**options: Any) -> Any:
            settings = {name: options.pop(name) for name in names}
            return command(**options, settings=settings)

        return with_parameters(wrapper, kept[:cut] + made + kept[cut:])

    return decorate


def with_parameters(
    wrapper: Callable[..., Any], parameters: list[inspect.Parameter]
) -> Callable[..., Any]:
    """``wrapper`` (a ``functools.wraps`` of a command) as typer sees a command taking
    ``parameters``: typer reads the signature and annotations set here, not the command's."""
    wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    del wrapper.__wrapped__  # type: ignore[attr-defined]
    return wrapper
