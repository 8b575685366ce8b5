"""The drafter scripts end to end on the tiny llama: data (greedy, sampled, second turns),
features with the fused layers, a few training steps, a loadable fused head that drafts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import run_plain, run_scalar

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_script(module: str, monkeypatch, *argv: str) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.setattr(sys, "argv", [module, *argv])
    __import__(module).main()


@pytest.mark.parametrize("capture", [False, True])
def test_data_features_training_write_a_fused_head(tiny, model_dir, tmp_path, monkeypatch, capture):
    data, feats, out = tmp_path / "data", tmp_path / "feats", tmp_path / "mtp"
    target = str(model_dir["llama"])
    extra = ["--capture", "--fuse-layers", "0,1", "--feats", str(feats)] if capture else []
    run_script("drafter_data", monkeypatch, "--target", target, "--out", str(data), "--minutes", "2",
               "--prompts", "8", "--chunk", "4", "--width", "3", "--magpie", "2", "--max-tokens", "12",
               "--seq", "64", "--text-tokens", "512", *extra)
    assert (tmp_path / "feats_l0-1" / "gen0000.captured").exists() == capture
    first = json.loads((data / "gen_0000.json").read_text())["rows"]
    sampled = json.loads((data / "gen_s0000.json").read_text())["rows"]
    assert [r["prompt_ids"] for r in first] == [r["prompt_ids"] for r in sampled]
    assert {r["mode"] for r in sampled} == {"sampled"} and all(r["answer_ids"] for r in first)
    assert (data / "gen_t0000.json").exists() and (data / "gen_ts0001.json").exists()  # second turns (maybe empty)
    held = json.loads((SCRIPTS / "heldout_prompts.json").read_text())
    assert not {r["prompt"] for r in first} & set(held["chat"] + held["code"])
    run_script("train_mtp_head", monkeypatch, "--target", target, "--data", str(data), "--feats", str(feats),
               "--out", str(out), "--fuse-layers", "0,1", "--extract-minutes", "1", "--minutes", "0.05",
               "--vocab", "256", "--unroll", "2", "--batch", "2", "--eval-every", "1000")
    assert (tmp_path / "feats_l0-1").is_dir() and not feats.exists()  # fused features: their own folder
    from specbatch.kernels.drafters.mtp_checkpoint import load_head
    head = load_head(out / "best")
    assert head.fuse_layers == (0, 1) and head.config["draft_vocab"] == 256
    tokens, rounds = run_scalar(tiny, head, "def f(x):", k=2, max_tokens=10, ignore_eos=True)
    assert tokens == run_plain(tiny, "def f(x):", max_tokens=10, ignore_eos=True) and rounds


def test_follow_up_turns_after_chat_answers_only(tiny, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import argparse

    import drafter_data as dd
    rows = [{"kind": "chat", "prompt": "What is tea?", "mode": "greedy", "turn": 1, "prompt_ids": [5, 6],
             "answer_ids": [7, 8], "finish": "stop"},
            {"kind": "chat", "prompt": "Cut off?", "mode": "greedy", "turn": 1, "prompt_ids": [5], "answer_ids": [9],
             "finish": "length"},
            {"kind": "code", "prompt": "def f():", "mode": "greedy", "turn": 1, "prompt_ids": [5], "answer_ids": [9],
             "finish": "stop"}]
    (tmp_path / "gen_0000.json").write_text(json.dumps({"rows": rows}))
    args = argparse.Namespace(seed=0, temperature=0.7, max_tokens=8)
    out, jobs = dd.chunk_jobs(tiny.tokenizer, tmp_path / "gen_t0000.json", [], "turn2:gen_0000.json", args)
    assert [r["prompt"] for r in out] == ["What is tea?", "Cut off?"] and out[0]["turn"] == 2
    assert [r["first_finish"] for r in out] == ["stop", "length"]
    assert jobs[0][1].temperature == 0.0 and tiny.tokenizer.decode(jobs[0][0]).count(out[0]["follow_up"]) == 1


def test_seeded_answers_do_not_depend_on_the_width(tiny, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import drafter_data as dd

    from specbatch.kernels.runner import ModelRunner
    from specbatch.runtime.params import SamplingParams
    prompts = [list(tiny.tokenizer.encode(p)) for p in ("def f(x):", "import os\n", "x = 1", "class A:\n", "# c\n" * 3)]
    jobs = [(p, SamplingParams(max_tokens=6 + i, temperature=0.7 if i % 2 else 0.0, seed=dd.row_seed(0, "t", i)))
            for i, p in enumerate(prompts)]
    runner = ModelRunner(tiny.model)
    alone = [r.tokens for r in dd.decode(runner, tiny.tokenizer, jobs, 1)]
    assert [r.tokens for r in dd.decode(runner, tiny.tokenizer, jobs, 4)] == alone
    assert alone == [run_plain(tiny, p, max_tokens=sp.max_tokens, temperature=sp.temperature, seed=sp.seed)
                     for p, sp in jobs]


def test_first_turn_chats_left_to_their_second_turns(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import drafter_common as dc
    rows = [{"kind": "chat", "prompt_ids": [5, 6], "answer_ids": [7]}, {"kind": "code", "prompt_ids": [5], "answer_ids": [9]}]
    first = tmp_path / "gen_s0001.json"
    first.write_text(json.dumps({"rows": rows}))
    assert dc.generated_sequences([first], eos=1) == [[5, 6, 7, 1], [5, 9, 1]]
    (tmp_path / "gen_ts0001.json").write_text(json.dumps({"rows": []}))  # its second turns hold the chat
    assert dc.generated_sequences([first], eos=1) == [[5, 9, 1]]


def test_captured_features_match_the_feature_pass(tiny, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import drafter_common as dc
    import drafter_data as dd
    import numpy as np
    from drafter_capture import CaptureRunner, write_chunks

    from specbatch.runtime.params import SamplingParams
    prompts = [list(tiny.tokenizer.encode(p)) for p in ("def f(x):", "import os\n", "x = 1", "class A:\n", "# c\n" * 3)]
    jobs = [(p, SamplingParams(max_tokens=5 + 3 * i, temperature=0.7 if i % 2 else 0.0, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    runner = CaptureRunner(tiny.model, (0, 1))
    requests = dd.decode(runner, tiny.tokenizer, jobs, 3)  # rows join and leave mid-way
    seqs = [runner.sequence(i, r.prompt + r.tokens[:-1]) for i, r in enumerate(requests)]
    for seq in seqs:
        ref = dc.features(tiny.model, [seq["tokens"].tolist()], (0, 1))
        assert (ref["greedy"][0] == seq["greedy"]).all()
        for key in ("hidden", "layers"):
            assert np.allclose(ref[key][0].astype(np.float32), seq[key].astype(np.float32), atol=2e-2), key
        for key in ("keys", "values"):
            assert np.allclose(ref[key][0].astype(np.float32), seq[key].astype(np.float32), atol=2e-2), key
    write_chunks(seqs, "gens0000", tmp_path)
    chunks = dc.load_chunks(names=["gens"], folder=tmp_path)
    again = dc.sequences_of(chunks)
    assert sorted(s["tokens"].tolist() for s in again) == sorted(s["tokens"].tolist() for s in seqs)
    assert dc.extract(tiny.model, "gens0000", [s["tokens"].tolist() for s in seqs], 0.0, folder=tmp_path) > 0


def test_fused_training_unroll_matches_drafting(tiny, monkeypatch):
    """The training unroll over cached features (fused input, own outputs fed back) gives the
    logits the drafter drafts at run time, step by step."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import drafter_common as dc
    import mlx.core as mx
    import train_mtp_head as tm
    from mlx_lm.models.cache import KVCache

    from specbatch.kernels.drafters.mtp import MTPDrafter, MTPHead, head_config
    from specbatch.kernels.runner import ModelRunner
    mx.random.seed(7)
    head = MTPHead(head_config(tiny.model.args, intermediate_size=64) | {"fuse_layers": [0, 1]})
    mx.eval(head.parameters())
    seq = [5, 9, 33, 7, 120, 44, 3, 81, 17]
    f = dc.features(tiny.model, [seq], (0, 1))
    s = {k: f[k][0] for k in ("tokens", "hidden", "keys", "values", "greedy", "layers")}
    b = tm.make_batch([s], 2)
    outs = tm.unrolled(head, tiny.model.model.embed_tokens.weight, b["tokens"], head.first_input(b["layers"]),
                       b["keys"], b["values"], 2)  # [1, N, D] per step
    runner = ModelRunner(tiny.model)
    drafter = MTPDrafter(head, runner)
    for n in range(len(seq) - 3):
        cache = KVCache()
        cache.keys, cache.values, cache.offset = b["keys"][..., :n + 1, :], b["values"][..., :n + 1, :], n + 1
        drafter.hidden = head.first_input(b["layers"][:, n])
        _, logits = drafter.draft(None, mx.array([seq[n + 1]]), 2, lambda lg, j: mx.array([seq[n + 2 + j]]), context=[cache])
        for j in range(2):
            assert mx.allclose(logits[0, j], runner.head(outs[j][0, n]), atol=1e-3), (n, j)


def test_more_questions_go_to_a_new_batch_and_leave_answered_chunks(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import types

    import drafter_data as dd

    class Tok:  # a chat template whose pre-query prefix is "<u>"; every row's text is its seed
        def apply_chat_template(self, messages, **_):
            return f"<u>{messages[0]['content']}</u><a>"

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(str, ids))

    def fake_decode(runner, tok, jobs, width, deadline=None):  # only 3 distinct questions in all
        return [types.SimpleNamespace(finish_reason="stop", seed=sp.seed % 3) for _, sp in jobs]

    monkeypatch.setattr(dd, "decode", fake_decode)
    monkeypatch.setattr(dd, "answer_ids", lambda r: [f"question number {r.seed}"])
    first = [{"kind": "chat", "prompt": f"old question {i}", "source": "magpie"} for i in range(3)]
    (tmp_path / "magpie.json").write_text(json.dumps(first))
    assert dd.make_magpie(None, Tok(), 3, 0, float("inf"), tmp_path, 2) == [first]  # enough: nothing written
    batches = dd.make_magpie(None, Tok(), 6, 0, float("inf"), tmp_path, 2)
    assert len(batches) == 2 and batches[0] == first  # three seeds' questions, each once
    assert sorted(q["prompt"] for q in batches[1]) == [f"question number {i}" for i in range(3)]
    assert dd.magpie_batches(tmp_path) == [tmp_path / "magpie.json", tmp_path / "magpie_1.json"]
    plan = dd.generation_plan([], batches, 2, tmp_path)
    names = [path.name for path, _, _ in plan]
    assert names[:4] == ["gen_m0000.json", "gen_sm0000.json", "gen_tm0000.json", "gen_tsm0000.json"]
    assert "gen_m1-0000.json" in names and "gen_tsm1-0000.json" in names
    assert [p for path, p, _ in plan if path.name == "gen_m0000.json"][0] == first[:2]  # answered chunks keep their prompts


def test_a_head_replaces_the_default_only_where_it_beats_it(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from measure_drafters import destination
    assert destination([1.4, 1.6, 1.7, 1.75], None) == "mtp"
    assert destination([1.4, 1.45, 1.48, 1.5], None) == "mtp-candidate"  # not past 1.5
    assert destination([1.4, 1.6, 1.7, 1.75], [1.45, 1.66, 1.76, 1.81]) == "mtp-candidate"  # the shipped is better
    assert destination([1.5, 1.7, 1.8, 1.85], [1.45, 1.66, 1.76, 1.81]) == "mtp"
