"""The seams between collabopt and hivemind (``collabopt.engine.compat.SEAMS``): every hivemind method a class of
collabopt's overrides is listed, and the installed hivemind's sources are the ones collabopt's overrides were
written against."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import pytest

import collabopt
from collabopt.engine import compat


def collabopt_classes() -> list[type]:
    classes = []
    for info in pkgutil.walk_packages(collabopt.__path__, "collabopt."):
        if info.name.startswith("collabopt.integrations") or info.name.endswith("__main__"):
            continue  # (adapters: frameworks' classes, none of hivemind's; __main__ runs the CLI)
        module = importlib.import_module(info.name)
        classes += [value for value in vars(module).values()
                    if inspect.isclass(value) and value.__module__ == module.__name__]
    return classes


def overridden_hivemind_methods() -> set[str]:
    """Each hivemind method that a class of collabopt's (or a mixin of one) defines again: "module.Class.method" of
    the nearest hivemind class in the method resolution order that defines it."""
    found = set()
    for cls in collabopt_classes():
        mro = cls.__mro__
        for index, klass in enumerate(mro):
            if not klass.__module__.startswith("collabopt"):
                continue
            for name, value in vars(klass).items():
                if not isinstance(value, (types.FunctionType, classmethod, staticmethod, property)):
                    continue
                owner = next((base for base in mro[index + 1:]
                              if base.__module__.startswith("hivemind") and name in vars(base)), None)
                if owner is not None:
                    found.add(f"{owner.__module__}.{owner.__qualname__}.{name}")
    return found


def test_every_overridden_hivemind_method_is_a_listed_seam():
    overridden = overridden_hivemind_methods()
    # (the walk finds collabopt's classes: its record validators derive from hivemind's designed extension point)
    assert "hivemind.dht.validation.RecordValidatorBase.validate" in overridden
    assert sorted(overridden - set(compat.SEAMS)) == []
    assert sorted(set(compat.SEAMS) - overridden - set(compat.SEAM_READS)) == []  # no stale entry
    assert set(compat.SEAM_READS) <= set(compat.SEAMS)


def test_installed_hivemind_has_the_sources_the_seams_were_written_against():
    changed = compat.changed_seams()
    assert changed == {}, ("hivemind changed these methods that collabopt overrides or relies on: review "
                           f"collabopt's code at each against the new source, then update SEAMS: {changed}")


def test_a_changed_or_missing_source_is_named(monkeypatch: pytest.MonkeyPatch):
    name = "hivemind.dht.validation.RecordValidatorBase.validate"  # (a designed extension point: it stays)
    assert compat.seam_digest(name) == compat.SEAMS[name]
    monkeypatch.setitem(compat.SEAMS, name, "0" * 12)
    monkeypatch.setitem(compat.SEAMS, "hivemind.averaging.allreduce.AllReduceRunner.gone", "0" * 12)
    assert compat.changed_seams() == {name: compat.seam_digest(name),
                                      "hivemind.averaging.allreduce.AllReduceRunner.gone": None}
