"""At most one host read per optimizer step: what a GPU step must not wait for, counted on a CPU.

A host read is an op whose result the host needs before it can go on: .item(), bool() and int() of a tensor
(aten._local_scalar_dense), a boolean mask's selection and nonzero (the count of positions decides the shape),
torch.equal. On CUDA each is a synchronisation; on a CPU it costs nothing, so `HostReads` counts them. It counts
only reads of tensors the device would hold: what the host holds (the micro-batches, and whatever is computed
from them alone before they are copied to the device) may be read freely, since on a GPU it never leaves
the CPU. (torch.cuda.set_sync_debug_mode("error") checks the same on the GPU: bench/gpu.py.)"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import tiny_config
from nano_rlhf import dist
from nano_rlhf.model import GPT

READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "allclose"}


class HostReads(TorchDispatchMode):
    """Counts host reads of device tensors. Host tensors: those given (`host`), those made from Python values
    (torch.tensor) and every output of an op whose tensor inputs are all host tensors, except a copy to a
    device (aten._to_copy with a device: the script's copy to the device)."""

    def __init__(self, host):
        super().__init__()
        self.host = {id(t) for t in host}
        self.keep = list(host)          # ids stay unique while the tensors live
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        to_device = name == "_to_copy" and "device" in (kwargs or {})
        # torch.tensor(python value), and the scripts' shuffles (randperm(..., device="cpu")): on the CPU
        made_by_host = name in ("lift_fresh", "randperm")
        on_host = made_by_host or (bool(tensors) and all(id(t) in self.host for t in tensors) and not to_device)
        bool_index = name == "index" and any(t.dtype == torch.bool for t in tensors[1:])
        if not on_host and (name in READS or bool_index):
            self.reads.append(name)
        if on_host:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.host.add(id(t))
                    self.keep.append(t)
        return out


def fused_adamw(model):
    """What training.adamw gives on CUDA: the fused AdamW, which skips a non-finite step on the device."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def test_the_counter_can_fail():
    h = torch.ones(3)
    d = h.to("cpu", copy=True)
    with HostReads([h]) as m:
        float(h.sum())                   # the host's own tensor: free
        d[d > 0].sum()                   # a boolean selection on the device: a read
        float(d.sum())                   # a read
    assert m.reads == ["index", "_local_scalar_dense"]


def test_sft_step_reads_the_host_once():
    import train_sft
    from nano_rlhf.data import collate_sft
    dist.setup("cpu")
    torch.manual_seed(0)
    model = GPT(tiny_config())
    V = model.cfg.vocab_size
    examples = [(torch.randint(1, V, (n,)).tolist(), [0] * 3 + [1] * (n - 3)) for n in (9, 12, 7, 11)]
    micro = [collate_sft(examples[:2], 0), collate_sft(examples[2:], 0)]
    opts = type("O", (), {"dtype": "float32", "grad_clip": 1.0, "out_dir": "unused"})()
    opt = fused_adamw(model)
    train_sft.train_step(model, opt, micro, opts, 0)           # the first step makes AdamW's state
    with HostReads([t for mb in micro for t in mb]) as m:
        metrics = train_sft.train_step(model, opt, micro, opts, 1)
    # none inside; the one read is the .tolist() of the loss and the gradient norm at the end (no op on a CPU)
    assert m.reads == [], m.reads
    assert metrics["train/loss"] > 0


def test_grpo_update_reads_the_host_once():
    """train_ppo's update (GRPO: two minibatches of two micro-batches, two epochs, left-padded prompts, responses
    of several lengths) reads nothing back: the positions and the padding come from the rollout's host copy of
    the mask, the loss's normalisers and every logged sum stay on the device, the update is skipped or not by
    the fused AdamW's device flag. step_metrics then reads them all at once. (The rollout's own reads, in the
    sampler and with_logprobs, are the rollout issue's.)"""
    import train_ppo
    from nano_rlhf.cli import parse_args
    from nano_rlhf.rollout import Rollout
    from nano_rlhf.training import Learner
    dist.setup("cpu")
    torch.manual_seed(0)
    model = GPT(tiny_config())
    B, P, R = 8, 3, 5
    attn = torch.ones(B, P + R, dtype=torch.long)
    attn[::3, 0] = 0                                                  # left-padded prompts
    for b, n in enumerate((5, 3, 1, 4, 5, 2, 3, 5)):
        attn[b, P + n:] = 0                                           # responses of n tokens
    ids = torch.randint(1, model.cfg.vocab_size, (B, P + R)) * attn
    resp = attn[:, P:].float()
    r = Rollout(query_response=ids, attention_mask=attn.clone(), host_attention_mask=attn, response_mask=resp,
                has_eos=torch.ones(B), completions=[""] * B, scores=torch.randn(B), raw_scores=torch.randn(B),
                policy_mask=resp.clone())
    opts = parse_args(train_ppo.Options, ["--advantage", "grpo", "--samples_per_prompt", "2", "--batch_size", "4",
                                          "--num_minibatches", "2", "--micro_batch_size", "2", "--ppo_epochs", "2"])
    train_ppo.fill_defaults(opts)
    targets = train_ppo.advantages(r, estimator="grpo", beta=0.0, k=2)
    policy, gen = Learner(model, model, fused_adamw(model)), torch.Generator().manual_seed(0)
    train_ppo.update(r, targets, policy, None, opts, 0.0, gen)           # the first makes AdamW's state
    with HostReads([attn]) as m:
        sums = train_ppo.update(r, targets, policy, None, opts, 0.0, gen)
    assert m.reads == [], m.reads
    with HostReads([attn]) as m:
        metrics = train_ppo.step_metrics(r, torch.zeros(B), torch.zeros(B), sums, 0.0, 2)
    assert m.reads == [], m.reads       # the one read is the .tolist() of every figure at the end (no op on a CPU)
    assert sums["updates"] == 4 and metrics["train/grad_norm"] > 0 and 0 <= metrics["train/clipfrac"] <= 1


def test_a_non_finite_step_is_skipped_on_the_device_then_refused(tmp_path):
    """An infinite weight makes the loss non-finite: the fused AdamW's step is skipped by the device flag (no
    weight, moment or step count moves), then the run stops with one line naming the step."""
    import pytest
    import train_sft
    from nano_rlhf.data import collate_sft
    dist.setup("cpu")
    torch.manual_seed(0)
    model = GPT(tiny_config())
    micro = [collate_sft([(list(range(1, 9)), [0, 0, 0] + [1] * 5)], 0)]
    opts = type("O", (), {"dtype": "float32", "grad_clip": 1.0, "out_dir": str(tmp_path)})()
    opt = fused_adamw(model)
    train_sft.train_step(model, opt, micro, opts, 0)
    with torch.no_grad():
        model.trunk.blocks[0].mlp.c_fc.weight[0, 0] = float("inf")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    with pytest.raises(SystemExit):
        train_sft.train_step(model, opt, micro, opts, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(m[k], opt.state[p][k]) for m, p in zip(moments, model.parameters()) for k in m)


def test_fused_adamw_equals_foreach_and_their_states_resume_either_way():
    """The fused AdamW (training.adamw on CUDA) against foreach (on a CPU), 10 float32 steps from the same
    gradients: equal to float32 rounding (~1e-7 relative a step); each one's state loads into the other and the
    step after the load equals the uninterrupted one's."""
    torch.manual_seed(0)
    base = GPT(tiny_config())
    grads = [[torch.randn_like(p) for p in base.parameters()] for _ in range(12)]

    def train(fused, steps, state=None, start=0):
        model = GPT(tiny_config())
        model.load_state_dict(base.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                **({"fused": True} if fused else {"foreach": True}))
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        for g in grads[start:start + steps]:
            for p, x in zip(model.parameters(), g):
                p.grad = x.clone()
            opt.step()
        return model.state_dict(), opt.state_dict()

    fused, foreach = train(True, 10), train(False, 10)
    for k, v in fused[0].items():
        torch.testing.assert_close(v, foreach[0][k], rtol=1e-5, atol=1e-6)
    for saved_by, loaded_by in ((True, False), (False, True)):
        resumed = train(loaded_by, 2, train(saved_by, 10), start=10)
        straight = train(saved_by, 12)
        for k, v in resumed[0].items():
            torch.testing.assert_close(v, straight[0][k], rtol=1e-5, atol=1e-6)


def test_dpo_step_reads_the_host_once():
    """train_dpo.train_step (sigmoid loss, live reference, an NLL term, the L1 term): no read of the device before
    the one read of the step's sums, gradient norm and L1 distance at the end. make_batch keeps the response
    masks on the CPU (the host's), the ids copied to the device."""
    import train_dpo
    dist.setup("cpu")
    torch.manual_seed(0)
    policy, ref = GPT(tiny_config()), GPT(tiny_config())
    ref.requires_grad_(False)
    V = policy.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    ex = [{"prompt": torch.randint(2, V, (4,), generator=g).tolist(),
           "chosen": torch.randint(2, V, (n,), generator=g).tolist(),
           "rejected": torch.randint(2, V, (n + 2,), generator=g).tolist()} for n in (3, 6, 5, 4)]
    opts = train_dpo.Options(nll_coef=0.5, l1_coef=0.01)
    train_dpo.fill_defaults(opts)
    opt = fused_adamw(policy)
    init = [p.detach().clone() for p in policy.parameters()]

    micro = [train_dpo.make_batch(ex[:2], opts, 0, torch.device("cpu")),
             train_dpo.make_batch(ex[2:], opts, 0, torch.device("cpu"))]
    train_dpo.train_step(opts, policy, policy, ref, opt, micro, 4, init)
    with HostReads([b.resp for b in micro]) as m:
        means, grad_norm, l1, tokens = train_dpo.train_step(opts, policy, policy, ref, opt, micro, 4, init)
    assert m.reads == [], m.reads
    assert grad_norm > 0 and l1 > 0 and tokens > 0 and 0 <= means["train/reward_accuracy"] <= 1
