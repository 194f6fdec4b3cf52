"""RLG008 across the files of a tree: a trainer class of another file, handed the model twice positionally (its
``__init__``'s parameter names are its interface), and its clean twin."""

from __future__ import annotations

import textwrap

import pytest

TRAINER = '''
    class PairTrainer:
        def __init__(self, model, ref_model=None, args=None, beta=0.1):
            self.model = model
            self.ref_model = ref_model

        def train(self):
            return self.model, self.ref_model
'''

SCRIPT = '''
    from transformers import AutoModelForCausalLM
    from pkg.trainers import PairTrainer

    def main(args):
        model = AutoModelForCausalLM.from_pretrained(args.model_path)
        print("reference:", args.ref_model)
        other = {reference}
        trainer = PairTrainer(model, other, args=args, beta=args.beta)
        trainer.train()
'''


def _lint(tmp_path, monkeypatch, reference: str, preview: bool = False):
    from rlguard.lint.config import Layer, load_config
    from rlguard.lint.runner import run

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "trainers.py").write_text(textwrap.dedent(TRAINER))
    (pkg / "run.py").write_text(textwrap.dedent(SCRIPT.format(reference=reference)))
    monkeypatch.chdir(tmp_path)
    config = load_config([tmp_path], cli=Layer(select=["RLG008"], preview=preview), isolated=True)
    return [(f.code, f.path.replace("\\", "/"), f.line) for f in run(["."], config, cache=False).findings]


@pytest.mark.parametrize("preview", [False, True])
def test_the_model_handed_twice_to_a_trainer_of_another_file(tmp_path, monkeypatch, preview):
    # `args.ref_model` in the script makes the rule look at it (a trigger that renaming keeps); the
    # reference is known only by the parameter of the other file's __init__ that the alias is handed to
    found = _lint(tmp_path, monkeypatch, "model", preview)
    assert found == [("RLG008", "pkg/run.py", 9)]


def test_a_second_model_handed_as_the_reference_is_clean(tmp_path, monkeypatch):
    assert _lint(tmp_path, monkeypatch, "AutoModelForCausalLM.from_pretrained(args.ref_model)") == []
