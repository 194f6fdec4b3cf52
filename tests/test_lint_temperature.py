"""The temperature facts of the analysis core (``rlguard.lint.analysis.temperature``) and the RLG007 mechanisms
built on them, on whole modules."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from rlguard.lint import all_rules, lint_source
from rlguard.lint.analysis import Analysis
from rlguard.lint.analysis.temperature import (applies_temperature, autocast_region, loss_inputs, temperature_expr,
                                               upcast)

RLG007 = [all_rules()["RLG007"]]


def analysis(source: str) -> Analysis:
    return Analysis(cst.parse_module(textwrap.dedent(source)))


def findings(source: str) -> list[int]:
    return [f.line for f in lint_source(textwrap.dedent(source), "t.py", rules=RLG007).findings]


def expr(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


@pytest.mark.parametrize("code, expected", [
    ('cfg["generation"]["temperature"]', True), ("self.args.temperature", True), ("tau", True),
    ("rollout_temperature", True), ('cfg.get("temperature", 1.0)', True), ("temperature or 1.0", True),
    ("scale", False), ("cfg.top_p", False), ("0.7", False), ("attempt", False),
])
def test_temperature_expr_reads_the_last_component(code, expected):
    assert temperature_expr(expr(code)) is expected


def test_applies_temperature_sees_divisions_keywords_and_helpers():
    a = analysis("""
        def scale(logits, cfg):
            return logits.div_(cfg["generation"]["temperature"])

        def train(model, mb, cfg):
            logits = scale(model(mb).logits, cfg)
            return logits

        def wrapper(policy, ids, tau):
            return policy(ids, temperature=tau).logits

        def raw(model, ids):
            return model(ids).logits.log_softmax(-1)
    """)
    funcs = {f.name.value: f for f in a.nodes(cst.FunctionDef)}
    assert applies_temperature(a, funcs["scale"])
    assert applies_temperature(a, funcs["train"])  # through the same-module helper
    assert not applies_temperature(a, funcs["train"], depth=0)
    assert applies_temperature(a, funcs["wrapper"])
    assert not applies_temperature(a, funcs["raw"])
    assert applies_temperature(a)


def test_sampling_calls_do_not_count_as_applying_a_temperature():
    a = analysis("""
        out = policy.generate(ids, do_sample=True, temperature=cfg.temperature)
        lp = policy(out).logits.log_softmax(-1)
    """)
    assert not applies_temperature(a)


def test_loss_inputs_follow_tuples_and_augmented_scaling():
    a = analysis("""
        def train(model, mb, loss_fn, n):
            logits = model(mb["ids"]).logits
            loss, metrics = loss_fn(logits, mb)
            loss *= n
            loss.backward()
    """)
    assert [a.code(c) for c in loss_inputs(a)] == ["loss_fn(logits, mb)"]


def test_autocast_region_and_upcast():
    a = analysis("""
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(ids)
        lp = out.logits.float().log_softmax(-1)
    """)
    calls = {a.code(c): c for c in a.nodes(cst.Call)}
    assert autocast_region(a, calls["net(ids)"]) is not None
    assert autocast_region(a, calls["out.logits.float().log_softmax(-1)"]) is None
    assert upcast(a, calls["out.logits.float().log_softmax(-1)"])


def test_symbolic_temperature_with_recomputed_old_logps():
    # the sampler's temperature is a config field and the trainer's log-probs are never divided, although the old
    # log-probs are recomputed by the trainer: both ratios are at 1 while the samples came from the sampler's
    # distribution
    assert findings("""
        class Trainer:
            def __init__(self, model, args):
                self.model = model
                self.request = RequestConfig(max_tokens=args.max_len, temperature=args.temperature)

            def logps(self, model, inputs):
                logits = model(**inputs).logits[:, :-1]
                return selective_log_softmax(logits, inputs["input_ids"][:, 1:])

            def prepare(self, inputs):
                inputs["old_per_token_logps"] = self.logps(self.model, inputs)
    """) == [9]


def test_symbolic_temperature_is_silent_when_the_module_scales_elsewhere():
    assert findings("""
        class Trainer:
            def __init__(self, model, args):
                self.model, self.temperature = model, args.temperature
                self.request = RequestConfig(max_tokens=args.max_len, temperature=args.temperature)

            def logps(self, model, inputs):
                logits = model(**inputs).logits[:, :-1] / self.temperature
                return selective_log_softmax(logits, inputs["input_ids"][:, 1:])

            def prepare(self, inputs):
                inputs["old_per_token_logps"] = self.logps(self.model, inputs)
    """) == []


def test_reference_logps_alone_are_not_the_policy_side():
    assert findings("""
        def score(ref_model, batch, cfg):
            params = SamplingParams(temperature=cfg.temperature, logprobs=0)
            logits = ref_model(batch["ids"]).logits
            return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["ids"][:, 1:, None]).squeeze(-1)
    """) == []


def test_a_config_default_that_names_another_config_field_does_not_loop():
    # found by the ecosystem check (RLG902: RecursionError in RLG007): a field default read from a config object
    # sent the value walk back to the same field forever
    from rlguard.lint import lint_source

    source = textwrap.dedent("""\
        class Config:
            temperature: float = config.temperature

        def sample(model, ids, config):
            out = model.generate(ids, temperature=config.temperature, do_sample=True)
            logits = model(out).logits / config.temperature
            return logits.log_softmax(-1)
        """)
    result = lint_source(source, "t.py")
    assert result.errors == []
