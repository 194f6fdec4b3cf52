"""RLG018 across the files of a tree: a reference built by a factory of another file (a class constructor, weights
loaded, handed back with no mode set, so in train mode), frozen by the script that never puts it in eval mode; the
script folder has no ``__init__.py`` and imports its own folder as a namespace package."""

from __future__ import annotations

import textwrap

import pytest

UTILS = '''
    import torch
    from model.net import TinyLM

    def count(model):
        return sum(p.numel() for p in model.parameters())

    def init_model(cfg, path, device="cpu"{mode_param}):
        model = TinyLM(cfg)
        model.load_state_dict(torch.load(path), strict=False)
        count(model){mode}
        return model.to(device), cfg.tokenizer
'''

SCRIPT = '''
    import sys
    import torch
    from trainer.utils import init_model

    def epoch(policy, ref, opt, batches):
        for ids in batches:
            with torch.no_grad():
                ref_lp = ref(ids).logits.log_softmax(-1)
            loss = (policy(ids).logits.log_softmax(-1) - ref_lp).mean()
            loss.backward()
            opt.step()

    if __name__ == "__main__":
        {policy}, tok = init_model(cfg, "w.pth")
        {ref}, _ = init_model(cfg, "w.pth")
        {ref} = {ref}{chain}.requires_grad_(False)
        opt = torch.optim.AdamW({policy}.parameters())
        epoch({policy}, {ref}, opt, [])
'''


def _lint(tmp_path, monkeypatch, chain="", mode="", mode_param="", names=("model", "ref_model"), preview=True):
    from rlguard.lint.config import Layer, load_config
    from rlguard.lint.runner import run

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "net.py").write_text("class TinyLM:\n    pass\n")
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    (trainer / "utils.py").write_text(textwrap.dedent(UTILS.format(mode=mode, mode_param=mode_param)))
    (trainer / "train.py").write_text(textwrap.dedent(SCRIPT.format(policy=names[0], ref=names[1], chain=chain)))
    monkeypatch.chdir(tmp_path)
    config = load_config([tmp_path], cli=Layer(select=["RLG018"], preview=preview), isolated=True)
    return [(f.code, f.path.replace("\\", "/"), f.line)
            for f in run(["trainer/train.py"], config, cache=False).findings]


@pytest.mark.parametrize("names", [("model", "ref_model"), ("a", "b")])
@pytest.mark.parametrize("preview", [False, True])
def test_a_factory_built_reference_never_put_in_eval_mode(tmp_path, monkeypatch, names, preview):
    assert _lint(tmp_path, monkeypatch, names=names, preview=preview) == [("RLG018", "trainer/train.py", 16)]


@pytest.mark.parametrize("kwargs", [
    {"chain": ".eval()"},                               # the script puts it in eval mode
    {"mode": "\n    model.eval()"},                     # the factory hands it back in eval mode
    {"mode": "\n    model.train(training)", "mode_param": ", training=False"},  # the factory sets a mode
])
def test_a_factory_built_reference_in_eval_mode_is_silent(tmp_path, monkeypatch, kwargs):
    assert _lint(tmp_path, monkeypatch, **kwargs) == []
