"""The scripts end to end on real model families: tiny Llama-3.1 and Qwen3 checkpoints made by transformers
(tests/hf_fixtures.py), trained with conversational data through their own chat templates; the output loads in
transformers with our logits, and its tokenizer renders in transformers as ours does."""
import json
import os

import pytest
import torch
from numerics import FLOAT32_ATOL  # float32 values of order one: see tests/numerics.py

import train_dpo
import train_unpaired
from hf_fixtures import FAMILIES, make_hf_dir, pref_rows, unpaired_rows, write_jsonl
from nano_rlhf import model as model_mod
from nano_rlhf.data import collate_pairs, load_records, tokenize_pairs
from nano_rlhf.model import GPT
from nano_rlhf.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")
transformers.logging.set_verbosity_error()

ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
END_OF_TURN = {"llama": "<|eot_id|>", "qwen3": "<|im_end|>"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family name, checkpoint directory), built once per module."""
    return request.param, make_hf_dir(tmp_path_factory.mktemp(request.param), request.param)


def metrics(path):
    return [json.loads(x) for x in open(os.path.join(path, "metrics.jsonl"))]


def check_loads_in_transformers(out_dir, family, policy):
    """The output directory: transformers' class of the family, our logits (1e-5) from transformers and from our
    reader, and AutoTokenizer's apply_chat_template rendering as our tokenizer does."""
    name, _ = family
    assert json.load(open(os.path.join(out_dir, "config.json")))["architectures"] == [ARCH[name]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert type(hf).__name__ == ARCH[name]
    ours = GPT.from_pretrained(out_dir).eval()
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    ids = torch.randint(0, tok.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = policy.eval()(ids)
        assert torch.allclose(hf(ids).logits, want, atol=FLOAT32_ATOL)
        assert torch.allclose(ours(ids), want, atol=FLOAT32_ATOL)
    at = transformers.AutoTokenizer.from_pretrained(out_dir)
    row = pref_rows(3, seed=5)[0]
    for msgs, gen in ((row["prompt"], True), (row["prompt"] + row["chosen"], False)):
        assert at.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == tok.render_text(msgs, gen)
    hf_ids = at.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert list(hf_ids) == tok.render_prompt(row["prompt"])
    # transformers' generate stops where ours does: at end-of-text or end-of-turn
    eos = hf.generation_config.eos_token_id
    assert set(tok.stop_ids) <= set(eos if isinstance(eos, list) else [eos])


# ---- train_dpo.py ----------------------------------------------------------------------------------

def dpo_args(tmp_path, init, out, loss="dpo", *extra, steps=2):
    kind = "unpaired" if loss == "kto" else "pref"
    if not (tmp_path / f"{kind}.jsonl").exists():
        rows = unpaired_rows if loss == "kto" else pref_rows
        write_jsonl(tmp_path / f"{kind}.jsonl", rows(16))
        write_jsonl(tmp_path / f"{kind}_eval.jsonl", rows(4, seed=1))
    algo = ["--method", "kto"] if loss == "kto" else ["--loss", loss]       # KTO: train_unpaired.py
    return [*algo, "--data", str(tmp_path / f"{kind}.jsonl"), "--eval_data", str(tmp_path / f"{kind}_eval.jsonl"),
            "--init", init, "--out_dir", str(tmp_path / out), "--max_steps", str(steps), "--batch_size", "2",
            "--log_interval", "1", "--eval_interval", "0", "--lr", "1e-3", "--warmup_steps", "0", *extra]


@pytest.mark.parametrize("loss", ["dpo", "kto"])
def test_dpo_trains_a_family_checkpoint_with_its_chat_template(tmp_path, family, loss):
    name, init = family
    main = train_unpaired.main if loss == "kto" else train_dpo.main
    out = main(dpo_args(tmp_path, init, "o", loss))       # no --tokenizer: tokenizer.json is in init
    m = metrics(tmp_path / "o")
    assert [x["step"] for x in m] == [1, 2] and all(torch.isfinite(torch.tensor(x["train/loss"])) for x in m)
    # the policy moved, the frozen reference did not
    start = GPT.from_pretrained(init).state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in out.policy.state_dict().items())
    assert all(torch.equal(v, start[k]) for k, v in out.ref.state_dict().items())
    run = json.load(open(tmp_path / "o" / "state" / "run.json"))["identity"]
    assert run["chat_template"] == {"llama": "llama3", "qwen3": "qwen3"}[name]
    assert run["date_string"] == ("26 Jul 2024" if name == "llama" else None)   # Llama 3.1 template's default
    check_loads_in_transformers(str(tmp_path / "o"), family, out.policy)


def test_grad_checkpoint_gives_the_same_loss(tmp_path, family, monkeypatch):
    _, init = family
    calls = []
    real = model_mod.checkpoint
    monkeypatch.setattr(model_mod, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = train_dpo.main(dpo_args(tmp_path, init, "plain"))
    assert not calls and not plain.policy.gradient_checkpointing
    ckpt = train_dpo.main(dpo_args(tmp_path, init, "ckpt", "dpo", "--grad_checkpoint"))
    # the blocks were recomputed (2 layers x forwards of 2 steps), and only the policy's
    assert len(calls) >= 4 and ckpt.policy.gradient_checkpointing and not ckpt.ref.gradient_checkpointing
    a, b = metrics(tmp_path / "plain"), metrics(tmp_path / "ckpt")
    assert a[0]["train/loss"] == b[0]["train/loss"] and a[0]["train/grad_norm"] == pytest.approx(b[0]["train/grad_norm"], rel=1e-6)
    assert a[1]["train/loss"] == pytest.approx(b[1]["train/loss"], rel=1e-6)
    # a run's own setting, not its identity: a run may be resumed with or without it
    assert "grad_checkpoint" not in json.load(open(tmp_path / "ckpt" / "state" / "run.json"))["identity"]


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_mask_covers_exactly_the_response_and_its_end_of_turn(tmp_path, name):
    """A conversational pair: the prompt is transformers' rendering with the generation prompt, the response
    mask covers exactly what follows it up to and including the end-of-turn token (Qwen3: with the empty
    thinking block its template puts in the final turn), and not the "\\n" ChatML writes after <|im_end|>."""
    d = make_hf_dir(tmp_path / name, name)
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    at = transformers.AutoTokenizer.from_pretrained(d)
    rec = load_records(write_jsonl(tmp_path / "p.jsonl", pref_rows(1, seed=3)), "preference")
    pairs, _ = tokenize_pairs(rec, tok, 128)
    ids, attn, resp, _ = collate_pairs(pairs, tok.pad_id)
    prompt, chosen = rec[0]["prompt"], rec[0]["chosen"]
    eot = tok.tk.token_to_id(END_OF_TURN[name])
    row, mask = ids[0][attn[0].bool()].tolist(), resp[0][attn[0].bool()].tolist()
    n_prompt = mask.index(1)
    assert mask == [0] * n_prompt + [1] * (len(row) - n_prompt)       # one contiguous span to the row's end
    text = lambda x: tok.tk.decode(x, skip_special_tokens=False)
    assert text(row[:n_prompt]) == at.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    content = chosen[0]["content"]
    head = "<think>\n\n</think>\n\n" if name == "qwen3" else ""
    assert text(row[n_prompt:]) == head + content + END_OF_TURN[name] and row[-1] == eot
    full = at.apply_chat_template(prompt + chosen, tokenize=False)
    assert full == text(row) + ("\n" if name == "qwen3" else "")     # what follows the end-of-turn is not trained
    # the same ids as transformers tokenizes the whole conversation (no merge across the prompt/response seam)
    hf_ids = at.apply_chat_template(prompt + chosen, tokenize=True)
    hf_ids = list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)
    assert hf_ids[:len(row)] == row


def test_resume_refuses_another_date_string(tmp_path, capsys):
    """The date a Llama 3 run rendered its system header with is part of the run: a resume that would render
    another one (another --date_string, or a default that moved, e.g. today) is refused in one line. (Llama only:
    no other family's template writes a date.)"""
    init = make_hf_dir(tmp_path / "llama", "llama")
    capsys.readouterr()                        # transformers' own progress output while building the fixture
    train_dpo.main(dpo_args(tmp_path, init, "o", "dpo", "--date_string", "05 Mar 2025", "--stop_at", "1"))
    with pytest.raises(SystemExit) as e:
        train_dpo.main(dpo_args(tmp_path, init, "o", "dpo", "--resume"))
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "date_string '05 Mar 2025' != '26 Jul 2024'" in err, err
    train_dpo.main(dpo_args(tmp_path, init, "o", "dpo", "--resume", "--date_string", "05 Mar 2025"))
    assert [x["step"] for x in metrics(tmp_path / "o")] == [1, 2]
    saved = Tokenizer.from_file(str(tmp_path / "o" / "tokenizer.json"))
    assert saved.date_string == "05 Mar 2025"
    assert "Today Date: 05 Mar 2025" in saved.render_text(pref_rows(1)[0]["prompt"], True)


def test_chat_template_the_tokenizer_cannot_render_is_one_line(tmp_path, family, capsys):
    name, init = family
    other = "llama3" if name == "qwen3" else "qwen3"
    with pytest.raises(SystemExit) as e:
        train_dpo.main(dpo_args(tmp_path, init, "o", "dpo", "--chat_template", other))
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: chat template {other}: "), err
    assert not (tmp_path / "o").exists()


def test_saved_llama_tokenizer_renders_the_run_date_in_transformers(tmp_path):
    init = make_hf_dir(tmp_path / "llama", "llama")
    out = train_dpo.main(dpo_args(tmp_path, init, "o", "dpo", "--date_string", "05 Mar 2025", steps=1))
    check_loads_in_transformers(str(tmp_path / "o"), ("llama", init), out.policy)


def test_chunked_logits_give_the_same_losses(tmp_path, family, monkeypatch):
    """response_logprobs goes through token_logprobs: with --logits_budget at 3 positions per chunk (each chunk
    recomputed in backward by the log-prob operator), the losses and gradient norms equal the one-chunk run's."""
    _, init = family
    one = train_dpo.main(dpo_args(tmp_path, init, "one"))
    calls = []
    real = model_mod._scaled_logits
    monkeypatch.setattr(model_mod, "_scaled_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    mib = 4 * 3 * one.policy.cfg.vocab_size / 2 ** 20            # 3 rows of float32 logits
    train_dpo.main(dpo_args(tmp_path, init, "chunked", "dpo", "--logits_budget", repr(mib)))
    assert len(calls) > 10                                   # chunks of 3 positions, recomputed in backward
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "chunked")
    for key in ("train/loss", "train/grad_norm", "train/reward_margin"):
        assert [x[key] for x in a] == pytest.approx([x[key] for x in b], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("name", FAMILIES)
def test_fixture_reward_model_loads_with_the_same_scores(tmp_path, name):
    from nano_rlhf.model import ScoreModel
    d = make_hf_dir(tmp_path / name, name, head="score")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(d).eval()
    ours = ScoreModel.from_pretrained(d).eval()
    ids = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(1))
    ids[ids == ours.cfg.pad_token_id] = 7                    # transformers scores the last non-pad token
    with torch.no_grad():
        want = hf(ids).logits[:, 0]
        got = ours(ids)[1]
    assert torch.allclose(got, want, atol=FLOAT32_ATOL)


@pytest.mark.slow
def test_dpo_ddp_two_ranks_equal_one_process_on_llama(tmp_path):
    """Llama's untied lm_head is applied outside the DDP-wrapped forward (token_logprobs on the returned hidden
    states): its gradient must still be all-reduced, so two ranks follow the one-process run."""
    from conftest import run, weights_close
    from safetensors.torch import load_file
    init = make_hf_dir(tmp_path / "llama", "llama")
    run(["train_dpo.py"] + dpo_args(tmp_path, init, "one", "dpo", "--batch_size", "4"))
    run(["train_dpo.py"] + dpo_args(tmp_path, init, "two", "dpo", "--batch_size", "2"), nproc=2)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert "lm_head.weight" in a and weights_close(a, b)
    assert not torch.equal(a["lm_head.weight"], load_file(os.path.join(init, "model.safetensors"))["lm_head.weight"])
    la, lb = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("train/loss", "train/grad_norm"):
        assert [x[key] for x in la] == pytest.approx([x[key] for x in lb], rel=1e-4), key
