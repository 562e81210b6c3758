"""A command's flags taken as one typed value: a frozen dataclass whose fields are typer options (``LaunchFlags``,
``HealFlags``, ``PlanFlags``), each option defined once in the dataclass and named by one parameter of every
command that takes them.

``@flag_groups`` hands Typer the signature it parses, the dataclass's fields standing where that parameter stands
(the same names, types, defaults and help as when each command listed them), and calls the command with the
dataclass built from the values Typer parsed. ``Annotated[LaunchFlags, Without("port")]`` takes the group without
some of its flags: they keep their defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing


class Without:
    """The flags of a group a command does not take (``Annotated[Group, Without("port", "lease")]``)."""

    def __init__(self, *names: str) -> None:
        self.names = frozenset(names)


def _group_of(annotation) -> tuple[type | None, frozenset[str]]:
    """The flag group an annotation names (a dataclass, or one Annotated with Without), and the flags left out."""
    without: frozenset[str] = frozenset()
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extras = typing.get_args(annotation)
        for e in extras:
            if isinstance(e, Without):
                without |= e.names
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation, without
    return None, without


def _fields(group: type, without: frozenset[str]) -> list[inspect.Parameter]:
    """The group's fields as the parameters Typer reads (their Annotated typer options and defaults)."""
    unknown = without - {f.name for f in dataclasses.fields(group)}
    if unknown:
        raise TypeError(f"{group.__name__} has no flag {sorted(unknown)}")
    hints = typing.get_type_hints(group, include_extras=True)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[f.name], default=f.default)
            for f in dataclasses.fields(group) if f.name not in without]


def flag_groups(command):
    """The command as Typer should see it: each parameter annotated with a flag group replaced by the group's
    flags, and the group built from them when the command runs (see the module's docstring)."""
    hints = typing.get_type_hints(command, include_extras=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for p in inspect.signature(command).parameters.values():
        group, without = _group_of(hints.get(p.name))
        if group is None:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation)))
            continue
        fields = _fields(group, without)
        groups[p.name] = (group, [f.name for f in fields])
        params += fields
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise TypeError(f"{command.__name__}: a flag given twice: {sorted({n for n in names if names.count(n) > 1})}")

    @functools.wraps(command)
    def parsed(**values):
        for name, (group, flags) in groups.items():
            values[name] = group(**{f: values.pop(f) for f in flags})
        return command(**values)

    parsed.__signature__ = inspect.Signature(params)
    parsed.__annotations__ = {p.name: p.annotation for p in params}
    return parsed
