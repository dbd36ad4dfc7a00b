"""The rollout room (nano_rlhf/rollout.py): tokenized prompts become one Rollout of k samples each, and that one
record is what every client reads: train_ppo.py's DAPO rounds re-pad and pick it (Rollout.cat / rows), and
evaluate and label sample through sample_groups."""
import ast
import inspect
from pathlib import Path

import torch

from conftest import prompt_rows, tiny_model
from nano_rlhf import rollout
from nano_rlhf.data import tokenize_prompts
from nano_rlhf.evaluate import sample_and_score
from nano_rlhf.rollout import Rollout, sample_groups
from nano_rlhf.sampling import SamplingOptions

ROOT = Path(__file__).resolve().parent.parent


def groups(tok, n, k, seed=0, version=0, max_new_tokens=10):
    model = tiny_model(tok, seed=seed)
    prompts, _ = tokenize_prompts(prompt_rows(n, seed), tok, 30)
    sampling = SamplingOptions(max_new_tokens, 1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    return sample_groups(prompts, model, tok, sampling, k, torch.Generator().manual_seed(seed), version=version)


def test_sample_groups_records_k_samples_a_prompt_their_texts_prompts_and_weight_version(tok):
    r = groups(tok, 3, 4, version=7)
    B, R = r.response_mask.shape
    assert B == 12 and r.query_response.shape == r.attention_mask.shape == (12, r.query_len + R)
    assert r.prompts == [p["prompt"] for p in prompt_rows(3) for _ in range(4)]      # k consecutive rows a prompt
    assert r.weight_version.tolist() == [7] * 12
    resp = r.query_response[:, r.query_len:]
    assert r.completions == [tok.decode(row) for row in resp.tolist()]
    # the attention mask's response part is the response mask: the sampled tokens up to and including the stop
    assert torch.equal(r.attention_mask[:, r.query_len:].float(), r.response_mask)
    assert r.has_eos.tolist() == [float(any(t in tok.stop_ids for t in row)) for row in resp.tolist()]
    assert r.actions is r.response_mask and r.sampler_logprobs is None and r.scores is None


def test_cat_repads_to_the_longest_prompt_and_response_and_rows_picks_in_order(tok):
    a = groups(tok, 2, 2, seed=0, max_new_tokens=4)
    b = groups(tok, 3, 2, seed=5, max_new_tokens=12, version=3)
    for r, s in ((a, 1.0), (b, 2.0)):
        r.scores, r.policy_mask = torch.full((len(r.completions),), s), r.response_mask.clone()
    c = Rollout.cat([a, b], tok.pad_id)
    P, R = max(a.query_len, b.query_len), max(x.response_mask.shape[1] for x in (a, b))
    assert c.query_len == P and c.response_mask.shape == (10, R) and c.policy_mask.shape == (10, R)
    assert c.prompts == a.prompts + b.prompts and c.completions == a.completions + b.completions
    assert c.weight_version.tolist() == [0] * 4 + [3] * 6 and c.scores.tolist() == [1.0] * 4 + [2.0] * 6
    for part, rows in ((a, range(0, 4)), (b, range(4, 10))):
        for i, j in enumerate(rows):           # the same real tokens, padding added only at the ends
            real = c.attention_mask[j].bool()
            assert c.query_response[j][real].tolist() == part.query_response[i][part.attention_mask[i].bool()].tolist()
            assert c.response_mask[j].sum() == part.response_mask[i].sum()
    picked = c.rows([9, 0, 4])
    assert picked.prompts == [c.prompts[i] for i in (9, 0, 4)]
    assert torch.equal(picked.query_response, c.query_response[[9, 0, 4]])
    assert torch.equal(picked.policy_mask, c.policy_mask[[9, 0, 4]]) and picked.stats == {}
    assert Rollout.cat([a], tok.pad_id) is a


def test_evaluate_samples_what_sample_groups_samples(tok):
    """evaluate's sample_and_score is sample_groups over its batches (k = 1 a row, one generator a call)."""
    model = tiny_model(tok, seed=2)
    rows = prompt_rows(5, 1)
    sampling = SamplingOptions(10, 1.0)
    got = sample_and_score(model, tok, rows, sampling, seed=4, batch_size=64)
    prompts, _ = tokenize_prompts(rows, tok, model.cfg.block_size - 10)
    want = sample_groups(prompts, model, tok, SamplingOptions(10, 1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id), 1,
                         torch.Generator().manual_seed(4))
    assert [s["completion"] for s in got] == want.completions
    assert [s["length"] for s in got] == want.response_mask.sum(1).long().tolist()
    assert [s["eos"] for s in got] == want.has_eos.bool().tolist()


def test_the_rollout_room_calls_nothing_of_a_script():
    """No function of nano_rlhf/rollout.py calls one of its parameters, but the reward interface itself
    (`scores = reward(prompts, completions)`, nano_rlhf/reward.py); it imports no script and knows no options
    class."""
    tree = ast.parse((ROOT / "nano_rlhf" / "rollout.py").read_text())
    called = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        called += [f"{fn.name}({c.func.id})" for c in ast.walk(fn)
                   if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in params]
    assert set(called) <= {"read_reward(reward)"}, called
    source = inspect.getsource(rollout)
    assert "import train_" not in source and "opts" not in source
    assert [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id.endswith("Options")] == []
    assert not hasattr(rollout, "Samples")
