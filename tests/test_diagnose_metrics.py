"""step_row (one step's dashboard row), the JSONL logger, and reading JSONL / CSV / TensorBoard logs back."""

from __future__ import annotations

import json
import math
import struct

import pytest

from rlguard.diagnose import METRICS, HistoryError, MetricsLogger, read_history, step_row

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

CHAPTER_KEYS = ["step", "reward", "eval_pass", "entropy", "approx_kl", "clip_frac", "ratio_max", "ratio_min",
                "grad_norm", "length", "length_pass", "length_fail", "zero_adv_frac", "logp_gap", "kl_ref", "turns",
                "reads", "malformed", "hardcode"]


def test_metric_names_are_the_chapters():
    assert set(CHAPTER_KEYS) <= set(METRICS)


def _episodes():
    # 2 groups of 4: group 0 has signal, group 1 all fail (reward 0) -> zero_adv_frac 0.5
    rewards = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0]
    passed = [True, False, False, True, False, False, False, False]
    mask = torch.zeros(8, 6)
    lengths = [2, 3, 4, 2, 5, 6, 1, 3]
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return rewards, passed, mask, lengths


def test_step_row_from_tensors_and_lists_agree():
    rewards, passed, mask, lengths = _episodes()
    update = {"entropy": torch.tensor(0.4), "approx_kl": 1e-3, "clip_frac": 0.01, "ratio_max": 1.2,
              "ratio_min": 0.9, "grad_norm": torch.tensor(0.25), "kl_ref": 0.02, "note": "not a number"}
    extras = lambda eps: {"reads": 1.5, "malformed": sum(e == "bad" for e in eps) / len(eps),  # noqa: E731
                          "hardcode": torch.tensor(0.25)}
    episodes = ["ok", "bad", "ok", "ok", "ok", "bad", "ok", "ok"]
    a = step_row(3, torch.tensor(rewards), group_size=4, passed=torch.tensor(passed), action_mask=mask,
                 turns=torch.tensor([2.0] * 8), update=update, eval_pass=torch.tensor(0.5), episodes=episodes,
                 extras=extras, config={"kl_coef": 0.1})
    b = step_row(3, rewards, group_size=4, passed=passed, lengths=lengths, turns=[2] * 8, update=update,
                 eval_pass=0.5, episodes=episodes, extras=extras, config={"kl_coef": 0.1})
    assert a == b
    assert a["step"] == 3 and a["reward"] == pytest.approx(2.5 / 8)
    assert a["zero_adv_frac"] == 0.5
    assert a["length"] == pytest.approx(26 / 8)
    assert a["length_pass"] == pytest.approx(2.0) and a["length_fail"] == pytest.approx(22 / 6)
    assert a["pass_rate"] == 0.25 and a["turns"] == 2.0 and a["eval_pass"] == 0.5
    assert a["entropy"] == pytest.approx(0.4) and a["grad_norm"] == pytest.approx(0.25)
    assert a["malformed"] == 0.25 and a["hardcode"] == 0.25 and a["reads"] == 1.5 and a["kl_coef"] == 0.1
    assert "note" not in a
    assert all(isinstance(v, (int, float)) for v in a.values())
    json.dumps(a)  # a row is JSON-ready


def test_step_row_logp_gap_uses_trained_tokens_only():
    rewards, passed, mask, _ = _episodes()
    trainer = torch.zeros(8, 6)
    sampler = trainer.clone()
    sampler[mask == 0] = 5.0  # differences outside the mask do not count
    sampler[0, 0] = 0.8       # one trained token off by 0.8
    row = step_row(0, rewards, action_mask=mask, trainer_logp=trainer, sampler_logp=sampler)
    assert row["logp_gap"] == pytest.approx(0.8 / mask.sum().item())
    given = step_row(0, rewards, action_mask=mask, trainer_logp=trainer, sampler_logp=sampler,
                     update={"logp_gap": 1e-8})
    assert given["logp_gap"] == 1e-8


def test_step_row_without_optional_inputs_has_only_what_it_can_compute():
    row = step_row(0, [0.0, 1.0])
    assert row == {"step": 0, "reward": 0.5}
    no_pass = step_row(0, [0.0, 0.0], passed=[False, False], lengths=[3, 5])
    assert no_pass["length_pass"] == 0.0 and no_pass["length_fail"] == 4.0


def test_step_row_rejects_inconsistent_inputs():
    with pytest.raises(ValueError, match="groups of 3"):
        step_row(0, [1.0] * 8, group_size=3)
    with pytest.raises(ValueError, match="pass flags"):
        step_row(0, [1.0] * 4, passed=[True])
    with pytest.raises(ValueError, match="overwrite"):
        step_row(0, [1.0], extras={"reward": 2.0})
    with pytest.raises(ValueError, match="empty"):
        step_row(0, [])


def test_logger_writes_one_flushed_line_per_row_and_reads_back(tmp_path):
    path = tmp_path / "run.jsonl"
    log = MetricsLogger(path)
    log.log({"step": 0, "reward": 0.2, "grad_norm": torch.tensor(0.3)})
    assert path.read_text().count("\n") == 1  # flushed before close: a running job's log reads
    log({"step": 1, "reward": 0.3, "eval_pass": 0.1, "grad_norm": math.nan})
    log.close()
    rows = read_history(path)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["grad_norm"] == pytest.approx(0.3) and "eval_pass" not in rows[0]
    assert math.isnan(rows[1]["grad_norm"])
    with pytest.raises(ValueError):
        log.log({"step": 2})


def test_chapter_style_log_reads_directly(tmp_path):
    """A row as the chapter's log_metrics writes it (extra keys, eval_pass on some steps only; no step order)."""
    path = tmp_path / "chapter.jsonl"
    rows = [{"reward": 0.2, "n_episodes": 64, "submitted": 0.9, "loss_tokens": 13.0, "step": 1},
            {"reward": 0.1, "eval_pass": 0.1, "step": 0}, {}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    got = read_history(path)
    assert [r["step"] for r in got] == [0, 1] and got[1]["n_episodes"] == 64


@pytest.mark.parametrize("text, line, message", [
    ('{"step": 0, "reward": 0.1}\n{"step": 1, "reward": \n', 2, "not valid JSON"),
    ('{"step": 0}\n[1, 2]\n', 2, "JSON object"),
    ('{"step": 0, "reward": true}\n', 1, "not a number"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(HistoryError, match=message) as err:
        read_history(path)
    assert err.value.line == line and str(err.value).startswith(f"{path}:{line}:")


def test_missing_file(tmp_path):
    with pytest.raises(HistoryError, match="no such file"):
        read_history(tmp_path / "nope.jsonl")


def test_csv_reads_with_empty_cells_as_missing(tmp_path):
    path = tmp_path / "run.csv"
    path.write_text("step,reward,eval_pass\n0,0.1,0.05\n1,0.2,\n2,0.3,0.2\n")
    rows = read_history(path)
    assert rows[1] == {"step": 1, "reward": 0.2} and rows[2]["eval_pass"] == 0.2
    bad = tmp_path / "bad.csv"
    bad.write_text("step,reward\n0,0.1\n1,abc\n")
    with pytest.raises(HistoryError) as err:
        read_history(bad)
    assert err.value.line == 3


# --- TensorBoard: a hand-written event file (scalars as simple_value and as a float tensor) --------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    key = _varint(number << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def _event(step: int, tag: str, value: float, as_tensor: bool = False) -> bytes:
    if as_tensor:  # TensorProto: dtype DT_FLOAT (1), float_val (5) packed
        tensor = _field(1, 0, _varint(1)) + _field(5, 2, struct.pack("<f", value))
        val = _field(1, 2, tag.encode()) + _field(8, 2, tensor)
    else:
        val = _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", value))
    event = _field(1, 1, struct.pack("<d", 1.0)) + _field(2, 0, _varint(step)) + _field(5, 2, _field(1, 2, val))
    return struct.pack("<Q", len(event)) + b"\0" * 4 + event + b"\0" * 4


def test_tensorboard_event_file_reads_without_the_tensorboard_package(tmp_path):
    run = tmp_path / "tb" / "run1"
    run.mkdir(parents=True)
    version = _field(1, 1, struct.pack("<d", 0.0)) + _field(3, 2, b"brain.Event:2")  # a file_version event
    data = struct.pack("<Q", len(version)) + b"\0" * 4 + version + b"\0" * 4
    data += _event(0, "train/reward", 0.25) + _event(0, "train/logp_gap", 2.0, as_tensor=True)
    data += _event(1, "train/reward", 0.5) + _event(1, "train/logp_gap", 3.0, as_tensor=True)
    (run / "events.out.tfevents.123.host").write_bytes(data)
    rows = read_history(tmp_path / "tb")
    assert rows == [{"step": 0, "reward": 0.25, "logp_gap": 2.0}, {"step": 1, "reward": 0.5, "logp_gap": 3.0}]


def test_tensorboard_summary_writer_log_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(3):
        writer.add_scalar("rl/reward", 0.1 * step, step)
        writer.add_scalar("rl/grad_norm", 0.2, step)
    writer.close()
    rows = read_history(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["reward"] == pytest.approx(0.2) and rows[0]["grad_norm"] == pytest.approx(0.2)


def test_empty_tensorboard_dir_is_an_error(tmp_path):
    with pytest.raises(HistoryError, match="no TensorBoard event files"):
        read_history(tmp_path)
