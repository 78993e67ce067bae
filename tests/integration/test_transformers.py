"""The probe on real transformers model classes (GPT-2, Llama with GQA and left padding, BERT with
padding, ViT), built from tiny random-init configs: every site found and named, training
bit-identical, statistics recorded, and the rough edges a new user meets explained."""

from __future__ import annotations

import warnings

import pytest
import torch

from flashprobe.bench import tiny_models as tiny
from flashprobe.bench.tiny_models import TOKENS
from flashprobe.probing import ProbeWarning, probe

from ._training import assert_identical, train_steps

transformers = pytest.importorskip("transformers")


def test_gpt2_sites_and_bit_identical_training() -> None:
    plain = train_steps(tiny.gpt2(), tiny.tokens, tiny.logits)
    model = tiny.gpt2()
    with probe(model, backward=True) as p:
        probed = train_steps(model, tiny.tokens, tiny.logits)
    assert_identical(plain, probed)
    assert p.sites == ["transformer.h.0.attn", "transformer.h.1.attn"]
    summary = p.summary()
    assert summary.forward_calls == summary.backward_calls == 4
    assert 0 < summary.max_error_ratio < 2 and summary.nonfinite == 0 and not summary.notes


def test_llama_gqa_with_left_padding() -> None:
    batch = tiny.left_padded_tokens
    plain = train_steps(tiny.llama(), batch, tiny.logits)
    model = tiny.llama()
    with probe(model, backward=True) as p:
        probed = train_steps(model, batch, tiny.logits)
    assert_identical(plain, probed)
    assert p.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    stats = p.stats()["model.layers.0.self_attn"]
    # 4 query heads share 2 key/value heads (transformers repeats them before SDPA when a mask is
    # given, else passes enable_gqa=True): every gradient is compared, dq at the query heads' shape.
    assert stats["backward"]["dq"]["primary_golden"]["numel"] == 2 * (2 * 4 * TOKENS * 8)
    assert stats["backward"]["dk"]["primary_golden"]["numel"] in (2 * (2 * h * TOKENS * 8) for h in (2, 4))
    assert stats["nonfinite_inputs"] == {"q": 0, "k": 0, "v": 0, "grad_out": 0}
    assert p.summary().max_backward_error_ratio is not None


@pytest.mark.parametrize("attn", ["sdpa", "eager", "probe_kernel"])
def test_tiny_llama_with_each_attention_implementation(attn: str) -> None:
    """One tiny Llama (grouped-query heads, left padding), loaded with ``sdpa``, ``eager`` or a flashprobe
    kernel registered as ``probe_kernel``, trained two steps with and without the probe (its default
    settings: gradients compared): bit-identical; the attention modules are the sites, except under
    ``eager``, which makes no call to compare (warned at attach, said in the notes). The
    ``flex_attention`` load is ``test_llama_with_flex_attention_forward`` (forward: no CPU backward)."""
    from flashprobe.integrations.hf import register_attention

    if attn == "probe_kernel":
        register_attention("probe_kernel", "tiled:block_q=4,block_k=4")
    batch = tiny.left_padded_tokens
    plain = train_steps(tiny.llama(attn), batch, tiny.logits)
    model = tiny.llama(attn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProbeWarning)
        with probe(model) as p:
            probed = train_steps(model, batch, tiny.logits)
        summary = p.summary()
    assert_identical(plain, probed)
    if attn == "eager":
        assert p.sites == [] and "attn_implementation='sdpa'" in summary.notes[0]
        assert any("attn_implementation='eager'" in str(w.message) for w in caught)
        return
    assert p.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert summary.forward_calls == summary.backward_calls == 4
    assert summary.verdict == "pass" and summary.shadow_errors == 0


def test_bert_attention_dropout_is_explained() -> None:
    batch, output = tiny.left_padded_tokens, tiny.last_hidden_state
    plain = train_steps(tiny.bert(attention_probs_dropout_prob=0.1), batch, output)
    model = tiny.bert(attention_probs_dropout_prob=0.1)
    with pytest.warns(ProbeWarning, match="attention dropout"), probe(model, backward=True) as p:
        probed = train_steps(model, batch, output)
    assert_identical(plain, probed)  # BERT's dropout masks are unchanged: no random number drawn
    summary = p.summary()
    assert p.sites == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    assert summary.forward_calls == 4 and summary.backward_calls == 0
    assert summary.dropout_calls == 4
    (note,) = summary.notes
    assert "backward is not compared" in note and "attention_probs_dropout_prob" in note


def test_vit_sites() -> None:
    model = tiny.vit()
    with probe(model) as p:
        model(**tiny.vit_batch(0))
    assert len(p.sites) == 2 and all(site.endswith("attention") for site in p.sites), p.sites
    assert p.summary().forward_calls == 2


def test_eager_attention_implementation_warns_with_the_fix() -> None:
    model = tiny.gpt2("eager")
    with pytest.warns(ProbeWarning, match="attn_implementation='eager'"):  # at attach time
        p = probe(model)
    with p:
        model(**tiny.tokens(0))
    with pytest.warns(ProbeWarning, match="attn_implementation='sdpa'"):
        summary = p.summary()
    assert summary.sites == 0 and "attn_implementation='sdpa'" in summary.notes[0]


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_compiled_gpt2_matches_compiled_without_probe(backend: str) -> None:
    torch._dynamo.reset()
    model = tiny.gpt2()
    plain = train_steps(model, tiny.tokens, tiny.logits, call=torch.compile(model, backend=backend))
    torch._dynamo.reset()
    model = tiny.gpt2()
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProbeWarning)
        with probe(compiled, backward=True) as p:
            probed = train_steps(model, tiny.tokens, tiny.logits, call=compiled)
    assert_identical(plain, probed)
    assert p.sites == ["transformer.h.0.attn", "transformer.h.1.attn"]  # as in eager mode
    assert p.summary().backward_calls == 4 and p.summary().shadow_errors == 0


def _explain(model: torch.nn.Module):
    ids = tiny.tokens(0)["input_ids"]
    return torch._dynamo.explain(lambda x: model(input_ids=x).logits)(ids)


@pytest.mark.parametrize("make", [tiny.gpt2, tiny.llama], ids=["gpt2", "llama"])
def test_compiled_no_graph_break_one_op_per_attention_call(make) -> None:
    """docs/integrations.md "Graph breaks": torch._dynamo.explain counts no graph break with the probe
    attached, as without it; each attention call is one flashprobe::attention op in the graph."""
    torch._dynamo.reset()
    model = make()
    assert _explain(model).graph_break_count == 0
    torch._dynamo.reset()
    with probe(model, golden=False):
        explained = _explain(model)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    code = explained.graphs[0].code
    assert code.count("torch.ops.flashprobe.attention(") == 2  # the two layers' attention calls
    assert "scaled_dot_product_attention" not in code


@pytest.mark.slow
def test_compiled_llama_under_aot_eager_matches_compiled_without_probe() -> None:
    """Under aot_eager the probe's compiled training of a tiny Llama (GQA, causal) is bit-identical
    to the compiled training without it."""
    batch = tiny.tokens
    torch._dynamo.reset()
    model = tiny.llama()
    plain = train_steps(model, batch, tiny.logits, call=torch.compile(model, backend="aot_eager"))
    torch._dynamo.reset()
    model = tiny.llama()
    compiled = torch.compile(model, backend="aot_eager")
    with probe(model, backward=True) as p:
        probed = train_steps(model, batch, tiny.logits, call=compiled)
    torch._dynamo.reset()
    assert_identical(plain, probed)
    assert p.summary().backward_calls > 0 and p.summary().shadow_errors == 0


def test_llama_with_flex_attention_forward() -> None:
    """attn_implementation="flex_attention": transformers calls a compiled FlexAttention through its
    own wrapper, which the probe swaps: every call is a site, outputs are bit-identical, and the
    references apply transformers' score_mod and block mask (causal, left padding)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    model = tiny.llama("flex_attention").eval()
    batch = tiny.left_padded_tokens(0)
    with torch.no_grad(), warnings.catch_warnings():  # (no FlexAttention backward on the CPU)
        warnings.simplefilter("ignore")
        plain = model(**batch).logits  # compiles FlexAttention (seconds; cached on disk after)
        with probe(model) as p:
            probed = model(**batch).logits
    assert torch.equal(plain, probed)
    assert p.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for entry in p.stats().values():
        out = entry["forward"]["out"]
        assert entry["shadow_errors"] == 0 and out["verdict"] == "pass"
        assert out["primary_golden"]["max_abs"] < 1e-5  # the mask and padding applied as the model does
