"""The alignment rules (RLG001, RLG007, RLG012) on whole modules: the reference trainer's faults, its healthy
modules, and realistic multi-function trainers."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from rlguard.lint import all_rules, lint_source

ROOT = pathlib.Path(__file__).resolve().parents[1]
RULES = all_rules()
MINE = [RULES[c] for c in ("RLG001", "RLG007", "RLG012")]


def codes(source: str) -> list[tuple[int, str]]:
    # preview on: alignment facts are the same in both modes; some snippets name their roles only by variables
    return [(f.line, f.code) for f in lint_source(textwrap.dedent(source), "t.py", rules=MINE, preview=True).findings]


@pytest.mark.parametrize("fault, code", [("mask_shift", "RLG001"), ("label_shift", "RLG012"),
                                         ("sampler_temp", "RLG007")])
def test_reference_faults_are_flagged(fault, code):
    path = ROOT / "reference" / "faults" / f"{fault}.py"
    if not path.exists():
        pytest.skip("reference fault not written yet")
    assert code in {c for _, c in codes(path.read_text())}


def test_reference_trainer_is_clean():
    for path in sorted((ROOT / "reference").glob("*.py")):
        assert codes(path.read_text()) == [], path.name


def test_trl_style_grpo_is_clean():
    assert codes('''
        def selective_log_softmax(logits, index):
            return torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)

        class GRPOTrainer:
            def _get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
                logits = logits[:, :-1, :]
                input_ids = input_ids[:, -logits_to_keep:]
                logits = logits[:, -logits_to_keep:]
                logits = logits / self.temperature
                return selective_log_softmax(logits, input_ids)

            def compute_loss(self, model, inputs):
                completion_mask = inputs["completion_mask"]
                input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
                attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
                per_token_logps = self._get_per_token_logps(model, input_ids, attention_mask, completion_mask.size(1))
                coef = torch.exp(per_token_logps - inputs["old_per_token_logps"])
                per_token_loss = -coef * inputs["advantages"].unsqueeze(1)
                return (per_token_loss * completion_mask).sum() / completion_mask.sum()
    ''') == []


def test_mask_built_in_one_method_used_in_another():
    found = codes('''
        class Trainer:
            def make_batch(self, ids, owner):
                self.loss_mask = (owner[:, :-1] == POLICY).float()
                return ids

            def loss(self, model, ids, old_logp, adv):
                logits = model(ids)
                logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                ratio = (logp - old_logp).exp()
                return -(ratio * adv[:, None] * self.loss_mask).sum() / self.loss_mask.sum()
    ''')
    assert (4, "RLG001") in found


def test_helper_gather_judged_at_its_call_site():
    found = codes('''
        def gather_logp(logits, tokens):
            return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

        def train_step(policy, input_ids, old_logp):
            out = policy(input_ids)
            logp = gather_logp(out.logits, input_ids)
            return logp
    ''')
    assert (7, "RLG012") in found


def test_eval_sampling_at_other_temperature_is_ignored():
    assert codes('''
        TEMP = 1.0

        def evaluate(model, prompts):
            return model.generate(prompts, temperature=0.2, do_sample=True)

        def rollout(model, prompts):
            return model.generate(prompts, temperature=TEMP, do_sample=True)

        def loss(model, ids, old_logprobs):
            logits = model(ids).logits / TEMP
            return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])
    ''') == []
