"""The peer adapter (`uniprefill.peers`): transformers' attention interface runs a peer's prefill.

On CPU the stand-in peer ("blocks": a PyTorch block-sparse attention) checks the adapter:
at full density it equals the plain model, for batches, padding, generation and sliding-window
layers (SDPA serves those, with the reason counted), and the model's own attention comes back
afterwards. On a GPU with `minference` installed, each real peer at full density equals dense
attention, and at its defaults computes a share of the blocks.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import transformers

from uniprefill.eval.systems import System, peer_spec
from uniprefill.peers import PeerSpec, parse_peer
from uniprefill.peers.attention import PeerAttention
from uniprefill.peers.minference_loader import PeerUnavailable
from uniprefill.peers.reference import block_sparse_attention, standin_blocks


def tiny_llama(layers: int = 2) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


FULL = parse_peer("blocks:keep=1.0,min_tokens=64")


def test_parse_peer_settings_and_errors():
    spec = parse_peer("xattention:threshold=0.8,stride=16")
    assert spec.resolved["threshold"] == 0.8 and spec.resolved["stride"] == 16
    assert spec.resolved["block_size"] == 128  # the package's default
    assert parse_peer("flexprefill").label == "flexprefill (defaults)"
    assert parse_peer("flexprefill:max_budget=none").resolved["max_budget"] is None
    assert parse_peer("xattention:estimate=package").resolved["estimate"] == "package"
    with pytest.raises(ValueError, match="triton or package"):
        parse_peer("xattention:estimate=torch")
    with pytest.raises(ValueError, match="cannot be none"):
        parse_peer("flexprefill:gamma=none")
    with pytest.raises(ValueError, match="expected a number"):
        parse_peer("flexprefill:gamma=high")
    with pytest.raises(ValueError, match="not one of"):
        parse_peer("snapkv")
    with pytest.raises(ValueError, match="has no setting"):
        parse_peer("flexprefill:threshold=0.5")
    with pytest.raises(ValueError, match="name=value"):
        parse_peer("flexprefill:gamma")
    assert parse_peer("flexprefill:gamma=0.9").stable_hash() != parse_peer("flexprefill:gamma=0.8").stable_hash()


def test_reference_full_selection_is_causal_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 70, 16), torch.randn(2, 2, 70, 16), torch.randn(2, 2, 70, 16)
    blocks = standin_blocks(2, 4, 5, 1.0, q.device)
    out = block_sparse_attention(q, k, v, blocks, 16)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    sparse = block_sparse_attention(q, k, v, standin_blocks(2, 4, 5, 0.2, q.device), 16)
    assert not torch.allclose(sparse, dense, atol=1e-3)
    with pytest.raises(ValueError, match="expected"):
        block_sparse_attention(q, k, v, blocks[:, :, :4], 16)


def test_full_density_equals_the_plain_model_batch_and_padding():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 300))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    peer = PeerAttention(FULL)
    with torch.no_grad():
        plain = model(ids).logits
        plain_padded = model(ids, attention_mask=mask).logits
        with peer.applied(model):
            out = model(ids).logits
        assert peer.counts.sparse_calls == 2 and peer.counts.density == pytest.approx(1.0)
        peer.counts.reset()
        with peer.applied(model):
            padded = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out, plain, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(padded, plain_padded, atol=0, rtol=0)  # SDPA served it
    assert peer.counts.sparse_calls == 0
    assert peer.counts.sdpa_reasons == {"mask (padding, window or packing)": 2}
    assert model.config._attn_implementation == "sdpa"


def test_sparse_peer_changes_the_output_and_reports_its_density():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 320))
    peer = PeerAttention(parse_peer("blocks:keep=0.25,min_tokens=64"))
    with torch.no_grad():
        plain = model(ids).logits
        with peer.applied(model):
            out = model(ids).logits
    assert 0.2 < peer.counts.density < 0.5
    assert (out - plain).abs().max() > 1e-3


def test_generation_decodes_with_sdpa_and_matches():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200))
    peer = PeerAttention(FULL)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=6, do_sample=False)
        with peer.applied(model):
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, plain)
    assert peer.counts.sparse_calls == 2  # the prefill, in both layers
    assert peer.counts.sdpa_reasons["decode or cached keys"] == 2 * 5


def test_sliding_window_layers_and_short_prompts_go_to_sdpa():
    config = transformers.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=32, sliding_window=32, layer_types=["sliding_attention",
                                           "sliding_attention", "full_attention"], max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 200))
    peer = PeerAttention(FULL)
    with torch.no_grad():
        plain = model(ids).logits
        with peer.applied(model):
            out = model(ids).logits
        torch.testing.assert_close(out, plain, atol=2e-5, rtol=1e-4)
        assert peer.counts.sparse_calls == 1
        assert sum(peer.counts.sdpa_reasons.values()) == 2  # the sliding layers (masked or windowed)
        short = PeerAttention(parse_peer("blocks:min_tokens=1000"))
        with short.applied(model):
            model(ids)
    assert short.counts.sdpa_reasons["shorter than min_tokens"] == 1


def test_attention_comes_back_after_an_error_and_eager_models_are_refused():
    model = tiny_llama()
    peer = PeerAttention(FULL)
    with pytest.raises(RuntimeError, match="boom"):
        with peer.applied(model):
            assert model.config._attn_implementation == peer.name
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="SDPA"):
        with peer.applied(model):
            pass


def test_missing_minference_is_a_clear_error(monkeypatch):
    from uniprefill.peers import minference_loader, methods

    monkeypatch.setattr(minference_loader.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(minference_loader.sys.modules, minference_loader.PRIVATE, raising=False)
    q = torch.randn(1, 2, 512, 64, dtype=torch.bfloat16)
    with pytest.raises(PeerUnavailable, match=r"uniprefill\[peers\]"):
        methods.flexprefill(q, q, q, 0.125, PeerSpec("flexprefill").resolved)


def test_peer_system_in_a_bench_sweep():
    from uniprefill.bench.ttft import SweepPlan, format_results, sweep

    model = tiny_llama()
    plan = SweepPlan(lengths=(256,), baseline="eager", warmup=0, repeats=1,
                     peers=(FULL, parse_peer("blocks:keep=0.3,min_tokens=64")))
    results = sweep(model, plan, model_name="tiny", progress=False)
    peers = [r for r in results if r["peer"]]
    assert [r["role"] for r in results] == ["baseline", "method", "method"]
    assert peers[0]["density"] == pytest.approx(1.0) and peers[1]["density"] < 0.6
    assert peers[0]["drop_report"]["sparse_calls"] == 2
    assert "density 1.000" in format_results(results)
    assert model.config._attn_implementation == "sdpa"


def test_peer_system_spec_is_a_method():
    spec = peer_spec(FULL)
    assert not spec.is_baseline and spec.name.startswith("peer-blocks-")
    assert spec.as_dict()["peer"]["settings"]["keep"] == 1.0
    system = System(spec, tiny_llama())
    assert system.generation_pending is None and system.ideal_speedup({}, 256) is None


# ------------------------------------------------------------------ real peers, on a GPU

needs_peers = pytest.mark.skipif(importlib.util.find_spec("minference") is None,
                                 reason="minference is not installed (uniprefill[peers])")


@pytest.mark.gpu
@needs_peers
@pytest.mark.parametrize("text", ["flexprefill:gamma=1.0,tau=0", "xattention:threshold=1.0",
                                  "minference:vertical_size=100000,slash_size=100000"])
def test_real_peer_at_full_density_is_dense_attention(text):
    from uniprefill.peers.methods import PREFILL

    torch.manual_seed(0)
    spec = parse_peer(text)
    q = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, density = PREFILL[spec.method](q, k, v, 128 ** -0.5, spec.resolved)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert density == pytest.approx(1.0, abs=0.02)
    torch.testing.assert_close(out, dense, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_peers
@pytest.mark.parametrize("text", ["flexprefill", "xattention:threshold=0.5",
                                  # on random tensors MInference's default 6,096 diagonals are scattered and
                                  # touch every 64-block (density 1.0, docs/peers.md): a smaller budget here
                                  "minference:vertical_size=64,slash_size=64"])
def test_real_peer_defaults_compute_a_share_of_the_blocks(text):
    from uniprefill.peers.methods import PREFILL

    torch.manual_seed(0)
    spec = parse_peer(text)
    q = torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, density = PREFILL[spec.method](q, k, v, 128 ** -0.5, spec.resolved)
    assert torch.isfinite(out).all()
    assert 0.0 < density < 1.0


@pytest.mark.gpu
@needs_peers
def test_the_packages_own_xattention_estimate_masks_earlier_chunks():
    """Why `xattention_estimate` exists: off A100s the package's estimate, at a length that is a
    multiple of its chunk, sees only each query's own chunk, so even threshold 1 drops blocks."""
    from uniprefill.peers.methods import PREFILL

    torch.manual_seed(0)
    q = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ours = PREFILL["xattention"](q, k, v, 128 ** -0.5, parse_peer("xattention:threshold=1.0").resolved)[1]
    package = PREFILL["xattention"](q, k, v, 128 ** -0.5,
                                    parse_peer("xattention:threshold=1.0,estimate=package").resolved)[1]
    if "100" in torch.cuda.get_device_name():
        pytest.skip("on an A100 the package takes its Triton path")
    assert ours == pytest.approx(1.0, abs=0.02) and package < 0.8


def test_calls_a_peer_was_not_written_for_go_to_sdpa_with_their_reason():
    """Non-causal attention (an encoder) and extra terms (T5's position bias) are SDPA's, exactly."""
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=128,
                                                          max_position_embeddings=512), add_pooling_layer=False).eval()
    ids = torch.randint(0, 128, (1, 300))
    peer = PeerAttention(FULL)
    with torch.no_grad():
        plain = bert(ids).last_hidden_state
        with peer.applied(bert):
            out = bert(ids).last_hidden_state
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    assert peer.counts.sparse_calls == 0
    assert peer.counts.sdpa_reasons == {"not causal (encoder, cross-attention or vision tower)": 2}
    module = types.SimpleNamespace(is_causal=True)
    q = torch.randn(1, 2, 100, 16)
    reason = PeerAttention(parse_peer("blocks:min_tokens=8"))._sdpa_reason(
        module, q, q, None, 0.0, {"position_bias": torch.zeros(1)})
    assert reason == "extra attention terms (position bias, sinks or packed lengths)"


def test_two_systems_of_one_setting_keep_their_own_counts():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200))
    first, second = PeerAttention(FULL), PeerAttention(FULL)
    assert first.name != second.name
    with torch.no_grad(), first.applied(model):
        model(ids)
    assert first.counts.sparse_calls == 2 and second.counts.sparse_calls == 0


def test_generation_errors_of_a_peer_are_raised_not_recorded_as_pending(monkeypatch):
    from uniprefill.eval import runner

    system = System(peer_spec(FULL), tiny_llama())
    monkeypatch.setattr(system, "generate", lambda *a, **k: (_ for _ in ()).throw(PeerUnavailable("no kernel")))
    sample = types.SimpleNamespace(prompt="x", stop_at_newline=False, max_new_tokens=2, task="t", answers=["a"],
                                   to_dict=lambda: {"task": "t"})

    class Tok:
        pad_token_id, eos_token_id = 0, 1

        def __call__(self, text, return_tensors=None):
            ids = torch.randint(2, 128, (1, 80))
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    with pytest.raises(PeerUnavailable, match="no kernel"):
        runner.run_one(system, sample, Tok(), torch.device("cpu"), timed=False)


@pytest.mark.gpu
@needs_peers
def test_minference_keeps_the_nearest_diagonals_on_a_local_head():
    """A head that attends to itself and its neighbours: MInference's forced nearest 100 distances
    must include distance 0 (a sliced diagonal-sum array once dropped the 63 nearest: error ~1).
    100 diagonals are exactly the forced nearest 100 and keep the index near the diagonal (with 400,
    the other 300 fall on scattered distances and cover every 64 x 64 tile: density 1.0 on the H200;
    with fewer than 100, topk picks among 100 tied forced entries and may leave distance 0 out)."""
    from uniprefill.peers.methods import PREFILL

    torch.manual_seed(0)
    n, d = 2048, 64
    base = torch.nn.functional.normalize(torch.randn(1, 2, n, d, device="cuda"), dim=-1)
    q = (base * 128).to(torch.bfloat16)  # a logit of 16 on itself: the head attends to its own token
    k = base.to(torch.bfloat16)
    v = torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16)
    spec = parse_peer("minference:vertical_size=30,slash_size=100")
    out, density = PREFILL["minference"](q, k, v, d ** -0.5, spec.resolved)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert density < 0.5
    assert (out.float() - dense.float()).abs().max() < 0.1


def test_every_sub_config_is_switched_and_restored():
    """A multimodal model: the text and vision configs both run the peer inside the block (the vision
    tower's calls are not causal, so SDPA serves them) and get back exactly what they had."""
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, sliding_window=32,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.set_attn_implementation("sdpa")
    configs = (model.config, model.config.text_config, model.config.vision_config)
    peer = PeerAttention(FULL)
    ids = torch.randint(0, 290, (1, 200))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with peer.applied(model):
            assert {c._attn_implementation for c in configs} == {peer.name}
            out = model(input_ids=ids).logits
    assert [c._attn_implementation for c in configs] == ["sdpa"] * 3
    torch.testing.assert_close(out, plain, atol=2e-5, rtol=1e-4)
    assert peer.counts.sparse_calls == 1  # the one full-attention layer of the text model
