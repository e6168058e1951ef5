"""The merged-adapter baseline: one adapter whose delta is exactly the sum of its parts' deltas."""

import pytest
import torch

from molora.routing import AdapterError, SequenceRouter, UnknownAdapterError, merge_adapters


def test_merged_adapter_equals_both_adapters_applied_together(tiny_pipeline):
    pipe = tiny_pipeline
    name = pipe.merge_adapters(["text_style", "image_style"])
    assert pipe.adapters[name] == "merged"
    assert pipe.merge_adapters(["text_style", "image_style"]) == name  # idempotent

    routed = pipe.routed
    ids = torch.randint(5, pipe.vocab.vocab_size, (1, 12))
    with torch.no_grad():
        base = routed(ids, routers=None).logits
        text = routed(ids, routers=SequenceRouter("text_style")).logits
        image = routed(ids, routers=SequenceRouter("image_style")).logits
        merged = routed(ids, routers=SequenceRouter(name)).logits
    # LoRA deltas add up inside every layer, so compare one layer's delta exactly rather than logits.
    assert not torch.allclose(merged, text) and not torch.allclose(merged, image)
    assert torch.isfinite(merged).all() and not torch.allclose(merged, base)

    layer = next(iter(routed.cache.layers))
    t, i, m = (routed.adapter(n) for n in ("text_style", "image_style", name))
    x = torch.randn(3, t.weights[layer][0].shape[1])

    def delta(adapter):
        a, b = adapter.weights[layer]
        return (x @ a.t() @ b.t()) * adapter.scales[layer]

    torch.testing.assert_close(delta(m), delta(t) + delta(i), rtol=1e-5, atol=1e-6)
    pipe.remove_adapter(name)


def test_merge_rejects_unknown_names_and_single_adapters(tiny_pipeline):
    with pytest.raises(UnknownAdapterError, match="text_style"):
        tiny_pipeline.merge_adapters(["text_style", "nope"])
    with pytest.raises(AdapterError, match="at least two"):
        merge_adapters([tiny_pipeline.routed.adapter("text_style")], "solo")
    assert "text_style+nope" not in tiny_pipeline.adapters
