"""rlguard: catch the silent bugs of RL trainers for language models.

Subpackages share one vocabulary, the failure-mode codes in :mod:`rlguard.catalog`:

- :mod:`rlguard.lint` -- static linter (libcst only, never imports torch);
- :mod:`rlguard.contracts` -- runtime contracts for trainer functions (needs the ``[torch]`` extra);
- :mod:`rlguard.preflight` -- invariant checks that run a real update on a copy of the model;
- :mod:`rlguard.reference` -- a small reference GRPO trainer with injectable faults;
- :mod:`rlguard.diagnose` -- symptom rules over logged training metrics.
"""

__version__ = "0.1.0"
