"""Which summaries a linted tree keeps: a module's importers decide (the names they import, or all of it)."""

from __future__ import annotations

from rlguard.lint.runner import import_order


def _order(files: dict[str, str]):
    names = list(files)
    return import_order([files[n].encode() for n in names], names)


def test_from_import_keeps_only_the_imported_names():
    order = _order({"pkg.losses": "def a(): ...\ndef b(): ...\n",
                    "pkg.train": "from pkg.losses import a, c as d\n"})
    assert order.summarise("pkg.losses") == frozenset({"a", "c"})
    assert order.summarise("pkg.train") is False  # nobody imports it


def test_whole_module_imports_keep_everything():
    for line in ("import pkg.losses\n", "from pkg.losses import *\n", "from pkg.losses import (\n    a,\n)\n",
                 "from pkg import losses\n", "from . import losses\n"):
        order = _order({"pkg.losses": "def a(): ...\n", "pkg.train": line})
        assert order.summarise("pkg.losses") is True, line


def test_a_whole_import_wins_over_named_ones_in_any_order():
    for files in ({"m": "", "x": "from m import a\n", "y": "import m\n"},
                  {"m": "", "y": "import m\n", "x": "from m import a\n"}):
        assert _order(files).summarise("m") is True


def test_relative_from_import_names_the_sibling_module():
    order = _order({"pkg.losses": "def a(): ...\n", "pkg.train": "from .losses import a\n"})
    assert order.summarise("pkg.losses") == frozenset({"a"})
