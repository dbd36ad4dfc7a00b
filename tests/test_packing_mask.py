"""Packed rows in the model: GPT.forward(..., doc_ids=(B, T)) or attention_mask=(B, T, T).

Each document of a packed row must get exactly the logits (and, in a loss, the gradients) it gets alone in a
row, in every family: GPT-2's learned positions and the Llama family's rotary positions both restart at 0 per
document, and attention never crosses a document or reaches a pad. The references here run each document
alone through the ordinary forward; the (B, T, T) masks are built from the documents' lengths in the test.
"""
import pytest
import torch

from nano_rlhf.model import GPT, GPTConfig, document_attention
from numerics import assert_close64

pytestmark = pytest.mark.numeric     # also run under ATEN_CPU_CAPABILITY=default by .ci/run

V = 97
FAMILIES = {
    "gpt2": dict(model_type="gpt2", n_head=2, n_embd=32),
    "llama_gqa_llama3": dict(model_type="llama", n_head=4, n_kv_head=2, n_embd=48, intermediate_size=80,
                             tie_word_embeddings=False,
                             rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2_bias": dict(model_type="qwen2", n_head=4, n_kv_head=1, n_embd=48, intermediate_size=64,
                       attention_bias=True, rope_theta=1e6),
    "qwen3_qk_norm": dict(model_type="qwen3", n_head=4, n_kv_head=2, n_embd=32, head_dim=16, intermediate_size=64,
                          qk_norm=True, tie_word_embeddings=False, rope_theta=1e6),
}
PAD = 1
# two packed rows: documents of these lengths, then right padding up to the longest row
ROWS = [(7, 5, 9), (12, 3)]


def model_of(family, seed=0):
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=2, pad_token_id=PAD, **FAMILIES[family]))
    with torch.no_grad():       # norms at 1 and biases at 0 would hide terms: randomise everything
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


def packed_batch(rows=ROWS, seed=1):
    """(docs: per row a list of (L,) id tensors, ids (B, T), attention mask (B, T), doc ids (B, T) with -1 on pads)."""
    g = torch.Generator().manual_seed(seed)
    T = max(sum(r) for r in rows)
    docs = [[torch.randint(2, V, (n,), generator=g) for n in r] for r in rows]
    ids = torch.full((len(rows), T), PAD)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    doc = torch.full((len(rows), T), -1)
    for b, row in enumerate(docs):
        s = 0
        for k, d in enumerate(row):
            ids[b, s:s + len(d)], attn[b, s:s + len(d)], doc[b, s:s + len(d)] = d, 1, k
            s += len(d)
    return docs, ids, attn, doc


def block_diagonal(rows, T):
    """(B, T, T) bool: query i sees key j iff j <= i in the same document (pads see nothing but themselves)."""
    m = torch.zeros(len(rows), T, T, dtype=torch.bool)
    for b, row in enumerate(rows):
        s = 0
        for n in row:
            m[b, s:s + n, s:s + n] = torch.ones(n, n, dtype=torch.bool).tril()
            s += n
        for t in range(s, T):
            m[b, t, t] = True
    return m


def alone(model, docs):
    return [[model(d[None])[0] for d in row] for row in docs]


def assert_each_document_equals_it_alone(logits, docs, ref):
    for b, row in enumerate(docs):
        s = 0
        for k, d in enumerate(row):
            torch.testing.assert_close(logits[b, s:s + len(d)], ref[b][k], atol=2e-5, rtol=1e-4)
            s += len(d)


@pytest.mark.parametrize("family", FAMILIES)
def test_doc_ids_give_each_document_its_logits_alone(family):
    """doc_ids alone (no positions, no padding mask): positions restart per document and attention stays inside
    it; the pads, which carry their own id, change nothing and stay finite."""
    model = model_of(family)
    docs, ids, attn, doc = packed_batch()
    with torch.no_grad():
        logits = model(ids, doc_ids=doc)
        ref = alone(model, docs)
    assert torch.isfinite(logits).all()
    assert_each_document_equals_it_alone(logits, docs, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_doc_ids_with_padding_mask_and_the_4d_mask_agree(family):
    """doc_ids with a (B, T) padding mask, and a (B, T, T) block-diagonal mask built here, each give every document
    its logits alone; and the mask is what does it: the same row under plain causal attention (positions still
    restarting) differs on every document after the first."""
    model = model_of(family)
    docs, ids, attn, doc = packed_batch()
    T = ids.shape[1]
    with torch.no_grad():
        ref = alone(model, docs)
        by_doc = model(ids, attn, doc_ids=doc)
        by_mask = model(ids, block_diagonal(ROWS, T))
        by_mask_01 = model(ids, block_diagonal(ROWS, T).long())
        pos, _ = document_attention(doc, attn)
        leaky = model(ids, position_ids=pos)
    assert_each_document_equals_it_alone(by_doc, docs, ref)
    assert_each_document_equals_it_alone(by_mask, docs, ref)
    torch.testing.assert_close(by_mask_01, by_mask, atol=0, rtol=0)
    second = slice(ROWS[0][0], ROWS[0][0] + ROWS[0][1])
    assert not torch.allclose(leaky[0, second], ref[0][1], atol=1e-3)


@pytest.mark.parametrize("family", ["gpt2", "qwen3_qk_norm"])
def test_packed_loss_gradients_equal_unpacked(family):
    """Summed token NLL of the packed rows (targets inside each document only) and its gradients equal those of the
    documents one per row: nothing flows across documents in backward either (with gradient checkpointing on, so
    the mask also goes through the recomputed blocks)."""
    model = model_of(family).train().double()    # float64: the layouts sum in different orders (tests/numerics.py)
    docs, ids, attn, doc = packed_batch()

    def nll(logits, targets):
        return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    model.zero_grad()
    lp = model(ids, attn, doc_ids=doc).log_softmax(-1)
    # position t predicts t+1 only when both lie in the same document
    keep = (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] >= 0)
    packed = -lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)[keep].sum()
    packed.backward()
    g_packed = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    unpacked = sum(nll(model(d[None])[0, :-1], d[1:]) for row in docs for d in row)
    unpacked.backward()
    assert model.gradient_checkpointing
    assert packed.dtype == torch.float64
    assert_close64(packed, unpacked)
    for k, p in model.named_parameters():
        assert_close64(g_packed[k], p.grad, msg=k)

    model.zero_grad()
    lp = model(ids, attn, doc_ids=doc).log_softmax(-1)          # checkpointed blocks, masked: same gradients
    (-lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)[keep].sum()).backward()
    for k, p in model.named_parameters():
        assert_close64(g_packed[k], p.grad, msg=k)


def test_document_attention_positions_and_mask():
    """Positions count each document's tokens from 0 (documents need not be contiguous); pads (mask 0) see only
    themselves and no real token sees a pad."""
    doc = torch.tensor([[3, 3, 3, 8, 8, 3, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    pos, mask = document_attention(doc, attn)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 3, 0]]
    m = mask[0, 0]
    assert m[5].tolist() == [True, True, True, False, False, True, False]
    assert m[4].tolist() == [False, False, False, True, True, False, False]
    assert m[6].tolist() == [False] * 6 + [True] and not m[:6, 6].any()


def test_doc_ids_and_masks_of_the_wrong_shape_are_refused():
    model = model_of("gpt2")
    _, ids, attn, doc = packed_batch()
    T = ids.shape[1]
    with pytest.raises(ValueError, match=r"doc_ids \(2, 5\) must have the shape of input_ids"):
        model(ids, doc_ids=doc[:, :5])
    with pytest.raises(ValueError, match="not both"):
        model(ids, block_diagonal(ROWS, T), doc_ids=doc)
    with pytest.raises(ValueError, match=r"attention_mask \(2, 3, 3\) must be"):
        model(ids, torch.ones(2, 3, 3, dtype=torch.bool))
