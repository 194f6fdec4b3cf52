"""rlguard's static linter. Depends on libcst only: it never imports torch nor the code it reads."""

from rlguard.lint.engine import FileResult, lint_source
from rlguard.lint.rule import Finding, Invalid, Rule, Valid, Violation, all_rules

__all__ = ["Finding", "FileResult", "Invalid", "Rule", "Valid", "Violation", "all_rules", "lint_paths",
           "lint_source"]


def lint_paths(paths, select=None, ignore=None, config=None, jobs=1, cache=True, fix=False, preview=None):
    """Lint files and folders with the project's config; returns the findings sorted by path and position.
    See :func:`rlguard.lint.runner.lint_paths`."""
    from rlguard.lint.runner import lint_paths as _lint_paths

    return _lint_paths(paths, select=select, ignore=ignore, config=config, jobs=jobs, cache=cache, fix=fix,
                       preview=preview)
