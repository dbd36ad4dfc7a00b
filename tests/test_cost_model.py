"""train_rm.py --objective cost: Safe RLHF's cost model (Dai et al. 2024, eq. 6). Its loss against a float64 formula
written from the paper, its gradients, its metrics, a small run that learns to tell safe from unsafe on held-out
data, the exported directory (transformers parity, the kind and the statistics in config.json) and the refusals."""
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import WORDS, run, write_jsonl
from numerics import FLOAT32_ATOL, assert_close64
from nano_rlhf.data import collate_pairs, tokenize_pairs
from nano_rlhf.model import ScoreModel
from train_rm import cost_loss, evaluate, harm_ordered, tokenize


# ---- the loss: the paper's formula, written here from the paper ------------------------------------------------

def paper_cost_loss(c_w, c_l, safe_w, safe_l, lam=0.0):
    """Dai et al. 2024, eq. 6, one pair, in Python floats (float64): y_w is the more harmful response,
    s(y) = +1 when y is unsafe and −1 when it is safe; −log σ(x) = log(1 + e^(−x)), written stably for either
    sign of x. lam: the L2 term λ/2·(c_w² + c_l²)."""
    def nls(x):
        return math.log1p(math.exp(-x)) if x > 0 else -x + math.log1p(math.exp(x))
    s_w, s_l = (-1.0 if safe_w else 1.0), (-1.0 if safe_l else 1.0)
    return nls(c_w - c_l) + nls(s_w * c_w) + nls(s_l * c_l) + lam / 2 * (c_w ** 2 + c_l ** 2)


# (c_w, c_l, y_w safe?, y_l safe?): both safe, both unsafe, the usual mixed pair, a contradictory one (the more
# harmful response labelled safe, the safer one unsafe), ties, and costs far on either side
CASES = [(-0.3, -1.2, True, True), (2.0, 0.7, False, False), (1.5, -0.5, False, True), (-0.4, 0.9, True, False),
         (0.0, 0.0, True, True), (0.0, 0.0, False, False), (30.0, -25.0, False, True), (-40.0, 45.0, False, True),
         (0.25, 0.25, False, True)]


@pytest.mark.parametrize("lam", [0.0, 0.3])
def test_cost_loss_equals_the_papers_formula_in_float64(lam):
    c_w = torch.tensor([c[0] for c in CASES], dtype=torch.float64)
    c_l = torch.tensor([c[1] for c in CASES], dtype=torch.float64)
    s_w = torch.tensor([-1.0 if c[2] else 1.0 for c in CASES], dtype=torch.float64)
    s_l = torch.tensor([-1.0 if c[3] else 1.0 for c in CASES], dtype=torch.float64)
    got = cost_loss(c_w, c_l, s_w, s_l, lam)
    want = torch.tensor([paper_cost_loss(*c, lam) for c in CASES], dtype=torch.float64)
    assert got.shape == (len(CASES),)                                    # per pair, not reduced
    assert_close64(got, want)


def test_the_sign_terms_set_the_boundary_at_zero():
    """Only the sign terms tell the cost model where 0 is: shifting both costs by a constant leaves the ranking
    term unchanged and moves the loss; for a both-safe pair the loss falls as both costs go below 0, for a
    both-unsafe pair as both go above."""
    w, l = torch.tensor([0.5], dtype=torch.float64), torch.tensor([-0.5], dtype=torch.float64)
    safe, unsafe = torch.tensor([-1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    both_safe = [cost_loss(w + k, l + k, safe, safe).item() for k in (2.0, 0.0, -2.0, -4.0)]
    both_unsafe = [cost_loss(w + k, l + k, unsafe, unsafe).item() for k in (-4.0, -2.0, 0.0, 2.0)]
    assert both_safe == sorted(both_safe, reverse=True) and both_unsafe == sorted(both_unsafe, reverse=True)
    # a mixed pair is best served with y_w above 0 and y_l below it
    assert cost_loss(w, l, unsafe, safe).item() < cost_loss(w - 1.0, l - 1.0, unsafe, safe).item()
    assert cost_loss(w, l, unsafe, safe).item() < cost_loss(w + 1.0, l + 1.0, unsafe, safe).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cost_loss_finite_for_huge_costs(dtype):
    c = torch.tensor([1e4, -1e4, 3e38 if dtype == torch.float32 else 1e38], dtype=dtype)
    loss = cost_loss(c, -c, torch.ones(3, dtype=dtype), -torch.ones(3, dtype=dtype))
    assert torch.isfinite(loss).all() and loss.dtype == dtype


@pytest.mark.parametrize("lam", [0.0, 0.2])
def test_cost_loss_gradient_is_the_papers_derivative(lam):
    """d/dc_w = −σ(c_l − c_w) − s_w·σ(−s_w·c_w) + λ·c_w and d/dc_l = σ(c_l − c_w) − s_l·σ(−s_l·c_l) + λ·c_l,
    derived by hand from eq. 6; and torch.autograd.gradcheck against finite differences."""
    g = torch.Generator().manual_seed(0)
    c_w = (3 * torch.randn(12, generator=g, dtype=torch.float64)).requires_grad_()
    c_l = (3 * torch.randn(12, generator=g, dtype=torch.float64)).requires_grad_()
    s_w = torch.tensor([1.0, -1.0] * 6, dtype=torch.float64)
    s_l = torch.tensor([1.0, 1.0, -1.0, -1.0] * 3, dtype=torch.float64)
    cost_loss(c_w, c_l, s_w, s_l, lam).sum().backward()

    def sig(x):
        return 1 / (1 + math.exp(-x))
    want_w = [-sig(l - w) - s * sig(-s * w) + lam * w
              for w, l, s in zip(c_w.tolist(), c_l.tolist(), s_w.tolist())]
    want_l = [sig(l - w) - s * sig(-s * l) + lam * l
              for w, l, s in zip(c_w.tolist(), c_l.tolist(), s_l.tolist())]
    assert_close64(c_w.grad, torch.tensor(want_w, dtype=torch.float64))
    assert_close64(c_l.grad, torch.tensor(want_l, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda a, b: cost_loss(a, b, s_w, s_l, lam), (c_w.detach().requires_grad_(),
                                                                                  c_l.detach().requires_grad_()))


# ---- the pair in the cost model's order, and the evaluation's figures ------------------------------------------

def test_harm_ordered_puts_the_more_harmful_response_first_whatever_the_helpfulness_order():
    rec = {"prompt": "p", "chosen": " a", "rejected": " b", "safer": "chosen", "chosen_safe": True,
           "rejected_safe": False}
    assert harm_ordered(rec) == {"prompt": "p", "chosen": " b", "rejected": " a", "signs": [1.0, -1.0]}
    rec.update(safer="rejected", chosen_safe=False, rejected_safe=False)
    assert harm_ordered(rec) == {"prompt": "p", "chosen": " a", "rejected": " b", "signs": [1.0, 1.0]}
    rec.update(safer="chosen", chosen_safe=False, rejected_safe=True)        # contradictory labels: kept as given
    assert harm_ordered(rec)["signs"] == [-1.0, 1.0] and harm_ordered(rec)["chosen"] == " b"


def safety_rows(n, seed, filler=None):
    """Pairs whose responses differ in one marker word: "bad" / "terrible" make a response unsafe, "great" /
    "nice" leave it safe; random filler around it. Half the pairs mix a safe and an unsafe response (the safe one
    is safer), a quarter are both safe and a quarter both unsafe (the safer one named at random)."""
    r = random.Random(seed)
    filler = filler or [w for w in WORDS if w not in ("great", "nice", "bad", "terrible")]
    rows = []
    for i in range(n):
        kind = ("mixed", "mixed", "safe", "unsafe")[i % 4]

        def response(safe):
            before = "".join(" " + r.choice(filler) for _ in range(r.randint(0, 6)))
            after = "".join(" " + r.choice(filler) for _ in range(r.randint(0, 6)))
            return f"{before} {r.choice(['great', 'nice'] if safe else ['bad', 'terrible'])}{after}."
        safe_a = kind == "safe" or (kind == "mixed" and r.random() < 0.5)
        safe_b = kind == "safe" or (kind == "mixed" and not safe_a)
        a, b = response(safe_a), response(safe_b)
        safer = ("chosen" if safe_a else "rejected") if kind == "mixed" else r.choice(["chosen", "rejected"])
        rows.append({"prompt": "write a short review.", "chosen": a, "rejected": b, "safer": safer,
                     "chosen_safe": safe_a, "rejected_safe": safe_b})
    return rows


def score_model(tok, seed=0):
    from conftest import tiny_config
    torch.manual_seed(seed)
    return ScoreModel(tiny_config(tok)).eval()


def alone(model, tok, prompt, response):
    ids = tok.render_prompt(prompt) + tok.encode_response(response)
    with torch.no_grad():
        return model(torch.tensor([ids]))[1].double().item()


def test_evaluate_equals_float64_hand_computation(tok):
    """The evaluation's figures from each response scored alone: loss (eq. 6), the safer choice's accuracy, sign
    accuracy over responses, the share scored unsafe, the mean and (Bessel) std of the costs."""
    rows = safety_rows(11, seed=3)
    m = score_model(tok)
    with torch.no_grad():         # a larger head, centred by the final norm's bias (which shifts every cost alike)
        m.score.weight.mul_(30.0)
        first = sorted(alone(m, tok, r["prompt"], r[k]) for r in rows for k in ("chosen", "rejected"))
        w = m.score.weight[0]
        # halfway between the two middle costs, so that no cost sits at 0 itself, where its sign (and so
        # sign_accuracy and unsafe_share) would be the rounding's: the model's and the float64 oracle's differ
        lo, hi = first[len(first) // 2 - 1], first[len(first) // 2]
        assert hi - lo > 1e-3, (lo, hi)         # far above float32's rounding of a cost of this size
        middle = (lo + hi) / 2
        m.transformer.ln_f.bias.sub_(w * middle / w.dot(w))
    pairs, _ = tokenize([dict(r) for r in rows], tok, 64, "x", "cost")
    c_w, c_l, s_w, s_l = [], [], [], []
    for r in rows:
        h = harm_ordered(r)
        c_w.append(alone(m, tok, h["prompt"], h["chosen"]))
        c_l.append(alone(m, tok, h["prompt"], h["rejected"]))
        s_w.append(h["signs"][0])
        s_l.append(h["signs"][1])
    c = c_w + c_l
    assert 0 < sum(x > 0 for x in c) < len(c)
    losses = [paper_cost_loss(w, l, sw < 0, sl < 0, 0.1) for w, l, sw, sl in zip(c_w, c_l, s_w, s_l)]
    n = len(rows)
    mean = sum(c) / (2 * n)
    want = {"eval/loss": sum(losses) / n, "eval/accuracy": sum(w > l for w, l in zip(c_w, c_l)) / n,
            "eval/sign_accuracy": sum((x > 0) == (s > 0) for x, s in zip(c, s_w + s_l)) / (2 * n),
            "eval/unsafe_share": sum(x > 0 for x in c) / (2 * n), "eval/unsafer_cost": sum(c_w) / n,
            "eval/safer_cost": sum(c_l) / n, "eval/margin": (sum(c_w) - sum(c_l)) / n, "eval/score_mean": mean,
            "eval/score_std": math.sqrt(sum((x - mean) ** 2 for x in c) / (2 * n - 1))}
    opts = SimpleNamespace(batch_size=4, dtype="float32", objective="cost", l2_coef=0.1)
    got = evaluate(m, pairs, pad_id=tok.pad_id, opts=opts)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-5), k
    assert "eval/chosen_score" not in got


# ---- end to end: a cost model that separates safe from unsafe on held-out data ---------------------------------

def cost_args(tmp_path, init, out, *extra, steps=60, n=1200, log=None):
    data = tmp_path / "safety.jsonl"
    if not data.exists():
        write_jsonl(data, safety_rows(n, seed=0))
        write_jsonl(tmp_path / "safety_eval.jsonl", safety_rows(200, seed=1))
    return ["--objective", "cost", "--data", str(data), "--eval_data", str(tmp_path / "safety_eval.jsonl"),
            "--init", init, "--out_dir", str(tmp_path / out), "--max_steps", str(steps), "--batch_size", "16",
            "--log_interval", str(log or steps), *extra]


def test_a_cost_model_learns_the_boundary_and_exports_like_a_reward_model(tmp_path, sft_dir):
    """60 steps of 16 pairs from a tiny random trunk: held-out responses (new filler) are put on their label's side
    of 0 and the safer choice of the mixed pairs is right; the directory loads in transformers with our costs, its
    config.json says it is a cost model and holds the eval-set statistics (recomputed here, each response alone)."""
    transformers = pytest.importorskip("transformers")
    import train_rm
    train_rm.main(cost_args(tmp_path, sft_dir, "cost"))
    out = tmp_path / "cost"
    final = [json.loads(x) for x in open(out / "metrics.jsonl")][-1]
    assert final["step"] == 60 and final["eval/sign_accuracy"] >= 0.95, final
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["score_kind"] == "cost" and cfg["architectures"] == ["GPT2ForSequenceClassification"]
    assert "reward_mean" not in cfg and "reward_std" not in cfg

    from nano_rlhf.tokenizer import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours = ScoreModel.from_pretrained(str(out)).eval()
    assert ours.extra_config["score_kind"] == "cost"
    held_out = [json.loads(x) for x in open(tmp_path / "safety_eval.jsonl")]
    c = {k: [alone(ours, tok, r["prompt"], r[k]) for r in held_out] for k in ("chosen", "rejected")}
    signs = [(x > 0) == (not r[f"{k}_safe"]) for k in c for x, r in zip(c[k], held_out)]
    assert sum(signs) / len(signs) >= 0.95
    mixed = [(r, a, b) for r, a, b in zip(held_out, c["chosen"], c["rejected"])
             if r["chosen_safe"] != r["rejected_safe"]]
    assert sum((a < b) == (r["safer"] == "chosen") for r, a, b in mixed) / len(mixed) >= 0.95
    every = torch.tensor(c["chosen"] + c["rejected"], dtype=torch.float64)
    assert cfg["cost_mean"] == pytest.approx(every.mean().item(), abs=1e-5)
    assert cfg["cost_std"] == pytest.approx(every.std().item(), rel=1e-4)
    assert cfg["cost_unsafe_share"] == pytest.approx((every > 0).double().mean().item())
    assert cfg["cost_sign_accuracy"] == final["eval/sign_accuracy"]

    hf = transformers.GPT2ForSequenceClassification.from_pretrained(str(out)).eval()
    ids, attn, _, _ = collate_pairs(tokenize_pairs(held_out[:6], tok, 64)[0], tok.pad_id)
    with torch.no_grad():
        assert torch.allclose(ours(ids, attn)[1], hf(ids, attention_mask=attn).logits.squeeze(-1), atol=FLOAT32_ATOL)


def test_a_model_directory_of_the_other_kind_is_refused(tmp_path, sft_dir, rm_dir, capsys, tok):
    """A cost model where a reward model is needed (a reward, a judge) and a reward model where a cost model is
    needed: one line naming the directory."""
    from nano_rlhf.reward import RewardModel, load_reward
    cost_dir = tmp_path / "cm"
    m = score_model(tok)
    m.save_pretrained(str(cost_dir), score_kind="cost", cost_mean=0.1)
    tok.save(str(cost_dir / "tokenizer.json"))
    with pytest.raises(SystemExit):
        load_reward(str(cost_dir), tokenizer=tok)
    err = capsys.readouterr().err.strip()
    assert err == (f'error: {cost_dir} is a cost model (its config.json says "score_kind": "cost"), given where a '
                   "reward model is needed")
    with pytest.raises(SystemExit):
        RewardModel.from_dir(rm_dir, tok, kind="cost")
    assert capsys.readouterr().err.strip().startswith(f"error: {rm_dir} is not a cost model")
    cost = RewardModel.from_dir(str(cost_dir), tok, kind="cost")
    assert not cost.has_stats and cost.mean == 0.0 and cost.std == 1.0          # costs are read raw


def test_ppo_lagrangian_takes_a_cost_model_directory_and_refuses_the_other_kind(tmp_path, sft_dir, rm_dir, capfd,
                                                                                tok):
    """train_ppo_lagrangian's --cost_model reads a cost model raw (its own critic starts from it); a reward model
    given as --cost_model, or a cost model as train_ppo's or its --reward_model, stops the run in one line before
    any work."""
    import train_ppo
    import train_ppo_lagrangian
    from conftest import metrics
    from test_ppo import main_exit, ppo_args
    cost_dir = tmp_path / "cm"
    score_model(tok, seed=3).save_pretrained(str(cost_dir), score_kind="cost")
    tok.save(str(cost_dir / "tokenizer.json"))
    for script, argv, message in (
            (train_ppo_lagrangian, ppo_args(tmp_path, sft_dir, rm_dir, "a", "--cost_model", rm_dir),
             f"error: {rm_dir} is not a cost model"),
            (train_ppo, ppo_args(tmp_path, sft_dir, str(cost_dir), "b"), f"error: {cost_dir} is a cost model"),
            (train_ppo_lagrangian, ppo_args(tmp_path, sft_dir, str(cost_dir), "b", "--cost_model", str(cost_dir)),
             f"error: {cost_dir} is a cost model")):
        code, err = main_exit(capfd, argv, script)
        errors = [x for x in err.splitlines() if x.startswith("error")]
        assert code == 1 and len(errors) == 1 and errors[0].startswith(message), err
    train_ppo_lagrangian.main(ppo_args(tmp_path, sft_dir, rm_dir, "c", "--cost_model", str(cost_dir), steps=1))
    assert "train/cost" in metrics(tmp_path / "c")[-1]


@pytest.mark.parametrize("flags,message", [
    (["--center_coef", "0.01"], "--center_coef applies only with --objective reward"),
    (["--use_margin", "false"], "--use_margin applies only with --objective reward"),
    (["--objective", "harm"], "--objective"),
])
def test_reward_only_options_are_refused_with_a_cost_model(tmp_path, sft_dir, capsys, flags, message):
    import train_rm
    with pytest.raises(SystemExit) as e:
        train_rm.main(cost_args(tmp_path, sft_dir, "x") + flags)
    assert e.value.code == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "error" in x]
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x").exists()


def test_rows_without_safety_labels_are_one_line_naming_file_and_line(tmp_path, sft_dir):
    rows = safety_rows(8, seed=0)
    del rows[5]["rejected_safe"]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    p = run(["train_rm.py", "--objective", "cost", "--data", data, "--init", sft_dir, "--out_dir",
             str(tmp_path / "o")], check=False)
    assert p.returncode == 1 and not (tmp_path / "o").exists()
    assert p.stderr.strip().splitlines() == [f"error: {data}:6: missing field 'rejected_safe' (the cost model needs "
                                             "'safer' (\"chosen\" or \"rejected\") and 'chosen_safe', 'rejected_safe' "
                                             "(true/false); the built-in task has them when generated with python -m "
                                             "nano_rlhf.tasks.synthetic --harm)"]


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_process(tmp_path, sft_dir):
    """The sign statistics are sums all-reduced with the others: 2 ranks x 4 pairs ≡ 1 process x 8."""
    common = ["--eval_interval", "2", "--warmup_steps", "1"]
    run(["train_rm.py"] + cost_args(tmp_path, sft_dir, "one", "--batch_size", "4", "--grad_accum", "2", *common,
                                    steps=4, n=80, log=1))
    run(["train_rm.py"] + cost_args(tmp_path, sft_dir, "two", "--batch_size", "2", "--grad_accum", "2", *common,
                                    steps=4, n=80, log=1), nproc=2)
    ma = [json.loads(x) for x in open(tmp_path / "one" / "metrics.jsonl")]
    mb = [json.loads(x) for x in open(tmp_path / "two" / "metrics.jsonl")]
    for key in ("train/loss", "train/grad_norm", "train/accuracy", "train/sign_accuracy"):
        assert [x[key] for x in ma] == pytest.approx([x[key] for x in mb], rel=1e-4), key
    evals = [(x, y) for x, y in zip(ma, mb) if "eval/sign_accuracy" in x]
    assert evals and all(x["eval/unsafe_share"] == pytest.approx(y["eval/unsafe_share"]) for x, y in evals)
