"""train_sft.py: the loss against float64, masking, global token-mean, DDP, resume, crash-safe saves."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import WORDS, weights_close, run, sft_rows, tiny_model, write_jsonl
from numerics import FLOAT32_ATOL, assert_close64
from nano_rlhf import checkpoint
from nano_rlhf.model import token_logprobs
from train_sft import sft_nll


class FakeLM:
    """Stands in for the model: its "hidden states" are the rows of a given logits tensor at the selected
    positions and its output layer is the identity, so the logits are exactly those rows; forward(targets=...)
    gives their log-probs through token_logprobs, as GPT.forward does."""

    def __init__(self, logits):
        self.logits = logits

    def __call__(self, ids, attn, select=None, targets=None):
        assert targets is not None, "sft_nll must take the log-probs from forward(..., targets=...)"
        h = self.logits[select] if select.dtype == torch.bool else self.logits.flatten(0, 1)[select]
        return token_logprobs(h, self.output_weight(), targets)

    def output_weight(self):
        return torch.eye(self.logits.shape[-1])


def test_sft_loss_equals_float64_hand_computation():
    torch.manual_seed(0)
    B, T, V = 3, 7, 11
    ids = torch.randint(0, V, (B, T))
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0],     # response of 3 tokens, then padding
                              [0, 1, 1, 1, 1, 1, 1],     # the first response token follows one prompt token
                              [0, 0, 0, 0, 0, 0, 1]])    # a single response token (the end-of-text)
    logits = torch.randn(B, T, V, dtype=torch.float64)
    nll, n = sft_nll(FakeLM(logits.float().requires_grad_()), ids, torch.ones_like(ids), loss_mask)
    want, count = 0.0, 0
    for b in range(B):
        for t in range(1, T):                          # token t is predicted by position t-1
            if loss_mask[b, t]:
                row = logits[b, t - 1]
                want += -(row[ids[b, t]] - torch.logsumexp(row, 0)).item()
                count += 1
    assert n == count == 10
    assert abs(nll.item() - want) < 1e-4


def test_prompt_and_padding_positions_get_zero_gradient():
    torch.manual_seed(1)
    ids = torch.randint(0, 9, (2, 6))
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    logits = torch.randn(2, 6, 9, requires_grad=True)
    nll, _ = sft_nll(FakeLM(logits), ids, torch.ones_like(ids), loss_mask)
    nll.backward()
    scored = F.pad(loss_mask[:, 1:], (0, 1)).bool()      # positions that predict a response token
    assert (logits.grad[~scored] == 0).all()
    assert (logits.grad[scored].abs().sum(-1) > 0).all()


def test_all_masked_batch_gives_zero_not_nan():
    ids = torch.randint(0, 9, (2, 5))
    nll, n = sft_nll(FakeLM(torch.randn(2, 5, 9)), ids, torch.ones_like(ids), torch.zeros_like(ids))
    assert n == 0 and nll.item() == 0.0


def test_real_model_loss_matches_full_logits(tok):
    m = tiny_model(tok)
    ex = [tok.encode_prompt_response("write a short review", " the motor is great."),
          tok.encode_prompt_response("review of the phone", " bad.")]
    from nano_rlhf.data import collate_sft
    ids, attn, lm = collate_sft(ex, tok.pad_id)
    nll, n = sft_nll(m, ids, attn, lm)
    logits = m(ids, attn).double()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    want = -(lp * lm[:, 1:]).sum()
    assert n == int(lm[:, 1:].sum()) and abs(nll.item() - want.item()) < 1e-4


# ---- the script end to end -------------------------------------------------------------------------

def sft_args(tmp_path, out, *extra, steps=4, seed=0):
    data = tmp_path / "sft.jsonl"
    if not data.exists():
        write_jsonl(data, sft_rows(96, seed=seed))
    return ["train_sft.py", "--data", str(data), "--out_dir", str(tmp_path / out), "--max_steps", str(steps),
            "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--vocab_size", "300", "--log_interval", "1",
            "--eval_interval", "0", "--warmup_steps", "1", *extra]


def weights(d):
    return load_file(os.path.join(d, "model.safetensors"))


@pytest.mark.slow
def test_global_token_mean_across_accumulation_and_ranks(tmp_path):
    """1 micro-batch of 4 == 4 micro-batches of 1 == 2 ranks x 2 micro-batches of 1 (variable lengths)."""
    run(sft_args(tmp_path, "a", "--batch_size", "4", "--grad_accum", "1"))
    tk = str(tmp_path / "a" / "tokenizer.json")
    run(sft_args(tmp_path, "b", "--batch_size", "1", "--grad_accum", "4", "--tokenizer", tk))
    p = run(sft_args(tmp_path, "c", "--batch_size", "1", "--grad_accum", "2", "--tokenizer", tk), nproc=2)
    assert "on all 2 rank(s)" in p.stdout           # end-of-run checksum check passed on both ranks
    a, b, c = weights(tmp_path / "a"), weights(tmp_path / "b"), weights(tmp_path / "c")
    assert weights_close(a, b) and weights_close(a, c)
    for key in ("train/loss", "train/grad_norm"):     # the gradient norm pins the normalisation exactly
        la = [json.loads(x)[key] for x in open(tmp_path / "a" / "metrics.jsonl")]
        lb = [json.loads(x)[key] for x in open(tmp_path / "b" / "metrics.jsonl")]
        lc = [json.loads(x)[key] for x in open(tmp_path / "c" / "metrics.jsonl")]
        assert la == pytest.approx(lb, rel=1e-4) and la == pytest.approx(lc, rel=1e-4), key


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path):
    args = ["--batch_size", "4", "--dropout", "0.1"]          # dropout: RNG state must be restored too
    run(sft_args(tmp_path, "straight", *args, steps=6))
    run(sft_args(tmp_path, "split", *args, "--stop_at", "3", steps=6))
    run(sft_args(tmp_path, "split", *args, "--resume", steps=6))
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert len(open(tmp_path / "split" / "metrics.jsonl").readlines()) == 6


def test_end_to_end_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    p = run(sft_args(tmp_path, "out", "--batch_size", "8", steps=5))
    assert "step 5/5" in p.stdout and "tok/s" in p.stdout
    out = tmp_path / "out"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "train_config.json", "metrics.jsonl"):
        assert (out / f).exists(), f
    from nano_rlhf.model import GPT
    ours = GPT.from_pretrained(str(out)).eval()
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    ids = torch.randint(2, ours.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=FLOAT32_ATOL)
    cfg = json.loads((out / "train_config.json").read_text())
    assert cfg["max_steps"] == 5 and cfg["lr"] > 0


def test_nonfinite_loss_stops_with_message(tmp_path):
    p = run(sft_args(tmp_path, "nan", "--batch_size", "8", "--lr", "1e3", "--grad_clip", "0",
                     "--save_interval", "1", steps=20), check=False)
    assert p.returncode != 0 and "non-finite" in p.stderr
    assert checkpoint.find_state(str(tmp_path / "nan")) is not None      # the last good state survives


def test_help_lists_every_option_with_default():
    p = run(["train_sft.py", "--help"])
    from train_sft import Options
    import dataclasses
    for f in dataclasses.fields(Options):
        assert f"--{f.name}" in p.stdout
    assert "(default: 0.002)" in p.stdout and "peak learning rate" in p.stdout


# ---- crash-safe checkpoints -------------------------------------------------------------------------

def _state(tmp_path, value):
    m = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(m.weight, value)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    return m, opt


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    m, opt = _state(tmp_path, 1.0)
    checkpoint.save_state(str(tmp_path), {"m": m}, {"m": opt}, {"step": 1})
    m2, opt2 = _state(tmp_path, 2.0)
    calls = {"n": 0}
    real = checkpoint.save_file

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed mid-save")
        return real(*a, **k)
    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_state(str(tmp_path), {"m": m2}, {"m": opt2}, {"step": 2})
    monkeypatch.setattr(checkpoint, "save_file", real)
    m3, opt3 = _state(tmp_path, 9.0)
    meta = checkpoint.load_state(str(tmp_path), {"m": m3}, {"m": opt3})
    assert meta["step"] == 1 and torch.equal(m3.weight, m.weight)
    assert torch.equal(opt3.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_crash_between_renames_falls_back_to_old(tmp_path, monkeypatch):
    m, opt = _state(tmp_path, 1.0)
    checkpoint.save_state(str(tmp_path), {"m": m}, {"m": opt}, {"step": 1})
    real = os.replace

    def crash(src, dst):
        if str(src).endswith("state.tmp"):
            raise KeyboardInterrupt("killed between renames")
        return real(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_state(str(tmp_path), {"m": m}, {"m": opt}, {"step": 2})
    monkeypatch.setattr(checkpoint.os, "replace", real)
    assert checkpoint.find_state(str(tmp_path)).endswith("state.old")
    assert checkpoint.load_state(str(tmp_path), {"m": m}, {"m": opt})["step"] == 1


def test_no_pickle_in_state(tmp_path):
    m, opt = _state(tmp_path, 1.0)
    checkpoint.save_state(str(tmp_path), {"m": m}, {"m": opt}, {"step": 1})
    files = os.listdir(tmp_path / "state")
    assert files and all(f.endswith((".safetensors", ".json")) for f in files)


# ---- bad flags and bad data sets: one line, before any work -----------------------------------------

BAD_FLAGS = [  # (flags, the option the error must name)
    (["--grad_clip", "-1"], "--grad_clip"), (["--grad_accum", "0"], "--grad_accum"),
    (["--grad_accum", "-1"], "--grad_accum"), (["--max_steps", "-1"], "--max_steps"),
    (["--epochs", "0"], "--epochs"), (["--epochs", "-1"], "--epochs"), (["--log_interval", "0"], "--log_interval"),
    (["--batch_size", "0"], "--batch_size"), (["--lr", "-0.001"], "--lr"), (["--lr", "0"], "--lr"),
    (["--eval_fraction", "0"], "--eval_fraction"), (["--eval_fraction", "1"], "--eval_fraction"),
    (["--warmup_steps", "-1"], "--warmup_steps"), (["--dropout", "1"], "--dropout"), (["--beta2", "1"], "--beta2"),
    (["--weight_decay", "-0.1"], "--weight_decay"), (["--eval_interval", "-1"], "--eval_interval"),
    (["--save_interval", "-5"], "--save_interval"), (["--stop_at", "-1"], "--stop_at"),
    (["--max_steps", "3", "--stop_at", "5"], "--stop_at"), (["--n_embd", "30", "--n_head", "4"], "--n_embd"),
    (["--device", "tpu"], "--device"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device")])


def run_main(main, argv, capsys):
    """main(argv) in this process -> (exit code, stderr lines); 0 if it returned."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("flags,option", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_before_any_work(tmp_path, capsys, flags, option):
    from train_sft import main
    out = tmp_path / "out"
    code, err = run_main(main, sft_args(tmp_path, "out")[1:] + flags, capsys)
    errors = [line for line in err if line.startswith("error:") or ": error:" in line]
    assert code != 0 and len(errors) == 1 and option in errors[0], err
    assert not out.exists()


def test_document_corpus_longer_than_the_context_trains(tmp_path):
    """{"text"} rows all longer than the context used to stop with "no example fits"; they keep their
    beginning now, and the stats line says how many were truncated."""
    import random
    r = random.Random(0)
    docs = [{"text": " ".join(r.choice(WORDS) for _ in range(200))} for _ in range(40)]
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    p = run(["train_sft.py", "--data", data, "--out_dir", str(tmp_path / "o"), "--max_steps", "2", "--n_layer", "1",
             "--n_head", "2", "--n_embd", "32", "--vocab_size", "300", "--batch_size", "4", "--block_size", "32"])
    assert "train examples (kept 38, truncated 38, dropped 0)" in p.stdout      # 2 of 40 held out
    assert "step 2/2" in p.stdout


def test_empty_eval_set_is_refused(tmp_path, capsys):
    """An eval file whose every example is too long used to report eval/loss 0.0."""
    from train_sft import main
    long_rows = [{"prompt": "p", "completion": " " + "the motor is great " * 40}] * 3
    ev = write_jsonl(tmp_path / "ev.jsonl", long_rows)
    code, err = run_main(main, sft_args(tmp_path, "o")[1:] + ["--eval_data", ev, "--block_size", "16"], capsys)
    assert code != 0 and err[-1] == f"error: {ev}: none of its 3 example(s) fits in 16 tokens (each response alone is longer)"


def test_eval_fraction_taking_every_row_says_so(tmp_path, capsys):
    from train_sft import main
    one = write_jsonl(tmp_path / "one.jsonl", sft_rows(1))
    code, err = run_main(main, ["--data", one, "--out_dir", str(tmp_path / "o")], capsys)
    assert code != 0 and err[-1] == (f"error: --eval_fraction 0.05 holds out all 1 row(s) of {one}, leaving none to "
                                     f"train on; pass --eval_data or more rows")
    assert not (tmp_path / "o").exists()


def test_tokenizer_larger_than_init_vocab_is_one_line(tmp_path, tok, capsys):
    from train_sft import main
    small = tmp_path / "small"
    tiny_model(tok, vocab_size=tok.vocab_size - 10).save_pretrained(str(small))
    tok.save(str(small / "tokenizer.json"))
    code, err = run_main(main, sft_args(tmp_path, "o")[1:] + ["--init", str(small)], capsys)
    assert code != 0 and err[-1].startswith(f"error: {small}: the tokenizer has {tok.vocab_size} tokens but the model's")


@pytest.mark.parametrize("what", ["missing", "file", "adapter", "no tokenizer"])
def test_an_init_that_is_not_a_model_says_what_it_is(tmp_path, tok, capsys, what):
    """--init of a missing path, a file, a LoRA adapter directory: one line saying what the path is (not "its
    tokenizer.json is missing"); a model directory without a tokenizer.json: pass --tokenizer."""
    from train_sft import main
    init = tmp_path / "init"
    if what == "file":
        init.write_text("{}")
    elif what == "adapter":
        init.mkdir()
        (init / "adapter_config.json").write_text("{}")
    elif what == "no tokenizer":
        tiny_model(tok).save_pretrained(str(init))
    code, err = run_main(main, sft_args(tmp_path, "o")[1:] + ["--init", str(init)], capsys)
    expected = {"missing": f"error: {init}: no such model directory",
                "file": f"error: {init}: a file, not a model directory",
                "adapter": f"error: {init}: a LoRA adapter directory, not a model",
                "no tokenizer": f"error: {init / 'tokenizer.json'}: missing; pass --tokenizer"}[what]
    assert code != 0 and len(err) == 1 and err[0].startswith(expected), err


def test_out_dir_inside_init_is_refused(tmp_path, tok, capsys):
    from train_sft import main
    init = tmp_path / "init"
    tiny_model(tok).save_pretrained(str(init))
    tok.save(str(init / "tokenizer.json"))
    out = init / "sub"
    args = sft_args(tmp_path, "o")[1:] + ["--init", str(init)]
    args[args.index("--out_dir") + 1] = str(out)
    code, err = run_main(main, args, capsys)
    assert code != 0 and err[-1].startswith(f"error: --out_dir {out} is, or is inside, the input --init {init}")
    assert not out.exists()


# ---- --packing ---------------------------------------------------------------------------------------

def packing_examples(tok):
    """Prompt/completion examples of varied lengths and a {"text"} example (loss on its first token too)."""
    from nano_rlhf.data import tokenize_sft
    rows = [{"prompt": "write a short review of the phone.", "completion": " the motor is great."},
            {"prompt": "review", "completion": " bad."},
            {"text": "i love this blender and the screen is fine."},
            {"prompt": "write a short review of the blender.", "completion": " it was loud and the battery is bad."},
            {"prompt": "a short review", "completion": " nice."}]
    return tokenize_sft(rows, tok, 64)[0]


def packed_and_unpacked(model, examples, block_size):
    """(packed NLL sum, count, grads) and (unpacked NLL sum, count, grads) of the same examples."""
    from nano_rlhf.data import collate_packed, collate_sft, pack_sft
    rows = pack_sft(examples, block_size)
    assert len(rows) < len(examples) and max(len(r[0]) for r in rows) <= block_size
    out = []
    for packed in (True, False):
        model.zero_grad()
        if packed:
            ids, attn, lm, pos, seg = collate_packed(rows, model.cfg.pad_token_id)
            nll, n = sft_nll(model, ids, attn, lm, pos, seg)
        else:
            ids, attn, lm = collate_sft(examples, model.cfg.pad_token_id)
            nll, n = sft_nll(model, ids, attn, lm)
        nll.backward()
        out.append((nll.item(), n, {k: p.grad.clone() for k, p in model.named_parameters()}))
    return out


@pytest.mark.numeric
def test_packed_loss_and_gradients_equal_unpacked(tok):
    """The packed batch's summed NLL, loss-token count and gradients equal those of the same examples one per
    row: positions restart per example and attention never crosses an example (GPT-2's learned positions
    would see any offset; a leak across examples would change every later example's loss)."""
    model = tiny_model(tok).double()      # float64: the layouts sum in different orders (see tests/numerics.py)
    (p_nll, p_n, p_grad), (u_nll, u_n, u_grad) = packed_and_unpacked(model, packing_examples(tok), 40)
    assert p_n == u_n > 0
    assert p_nll == pytest.approx(u_nll, rel=1e-12)
    for k in u_grad:
        assert_close64(p_grad[k], u_grad[k], msg=k)


def test_packed_logits_of_each_example_equal_it_alone(tok):
    from nano_rlhf.data import collate_packed, pack_sft
    model, examples = tiny_model(tok), packing_examples(tok)
    rows = pack_sft(examples, 40)
    ids, _, _, pos, seg = collate_packed(rows, tok.pad_id)
    with torch.no_grad():
        logits = model(ids, position_ids=pos, doc_ids=seg)
        i = 0
        for b, row in enumerate(rows):
            start = 0
            for n in row[2]:
                alone = model(torch.tensor([examples[i][0]]))[0]
                assert torch.allclose(logits[b, start:start + n], alone, atol=FLOAT32_ATOL), (b, i)
                start, i = start + n, i + 1
    assert i == len(examples)
    # and the mask is what makes it so: plain causal attention over the packed row differs
    with torch.no_grad():
        assert not torch.allclose(model(ids, position_ids=pos)[0, rows[0][2][0]:], logits[0, rows[0][2][0]:],
                                  atol=1e-3)


def test_segment_mask_is_block_diagonal_causal():
    from nano_rlhf.model import document_attention
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    want = torch.tensor([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [0, 0, 1, 0, 0, 0],
                         [0, 0, 1, 1, 0, 0],
                         [0, 0, 1, 1, 1, 0],
                         [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    pos, mask = document_attention(seg)
    assert torch.equal(mask, want[None, None]) and pos.tolist() == [[0, 1, 0, 1, 2, 0]]


@pytest.mark.slow
def test_packing_end_to_end_and_ddp_equals_one_process(tmp_path):
    """--packing trains (fewer rows than examples, logged), and 2 ranks x 1 packed row == 1 process x 2 rows
    (the model's forward with doc_ids is what DDP wraps and hooks)."""
    p = run(sft_args(tmp_path, "a", "--packing", "--batch_size", "2"))
    assert "packed" in p.stdout and "rows" in p.stdout
    tk = str(tmp_path / "a" / "tokenizer.json")
    run(sft_args(tmp_path, "b", "--packing", "--batch_size", "1", "--tokenizer", tk), nproc=2)
    assert weights_close(weights(tmp_path / "a"), weights(tmp_path / "b"))
    la = [json.loads(x)["train/loss"] for x in open(tmp_path / "a" / "metrics.jsonl")]
    lb = [json.loads(x)["train/loss"] for x in open(tmp_path / "b" / "metrics.jsonl")]
    assert la == pytest.approx(lb, rel=1e-4)


def test_from_scratch_tokenizer_gets_the_chat_template(tmp_path):
    """--chat_template on the from-scratch path: the trained tokenizer has the template's special tokens, the
    messages are rendered with it, and the saved tokenizer renders them the same in transformers."""
    transformers = pytest.importorskip("transformers")
    from train_sft import main
    from nano_rlhf.training import load_tokenizer
    msgs = [[{"role": "user", "content": f"write a short review of the {w}."},
             {"role": "assistant", "content": f"the {w} is great."}] for w in WORDS]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in msgs * 2])
    main(["--data", data, "--out_dir", str(tmp_path / "out"), "--max_steps", "1", "--n_layer", "1", "--n_head", "2",
          "--n_embd", "32", "--vocab_size", "300", "--chat_template", "chatml", "--batch_size", "4"])
    tok = load_tokenizer("", str(tmp_path / "out"))
    assert tok.chat_template == "chatml" and tok.eot_token == "<|im_end|>"
    ids, mask = tok.encode_conversation(msgs[0])
    assert ids.count(tok.eot_id) == 2 and tok.eot_id in [i for i, m in zip(ids, mask) if m]
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    got = hf.apply_chat_template(msgs[0], tokenize=True)
    assert (got["input_ids"] if hasattr(got, "keys") else got) == ids
