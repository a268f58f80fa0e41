import copy
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fuselab.kernels import cross_entropy  # noqa: E402
from fuselab.optim import FusedAdamW  # noqa: E402
from fuselab.patching import _FUSED_ROTARY_ACTIVE, FusedRMSNorm, FusedSwiGLUMLP, _token_positions, patch  # noqa: E402

LAYERS = 2
TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=16),
}
# Decoder norms (2 per layer) and the final norm; Qwen3 also normalizes q and k per head.
NORMS = {"llama": 2 * LAYERS + 1, "mistral": 2 * LAYERS + 1, "qwen2": 2 * LAYERS + 1, "qwen3": 4 * LAYERS + 1}


def _tiny_model(model_type, device, dtype=torch.float32):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[model_type]())
    return model.to(device=device, dtype=dtype)


def _model_and_patched_copy(model_type, device, dtype=torch.float32):
    """A tiny model and a patched deep copy of it, the two sides of a comparison."""
    model = _tiny_model(model_type, device, dtype)
    patched = copy.deepcopy(model)
    patch(patched)
    return model, patched


def _tokens(device, batch=2, seq=9):
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_patched_logits_match_float32(device, model_type):
    model = _tiny_model(model_type, device)
    patched = copy.deepcopy(model)
    record = patch(patched)
    assert record.count(FusedRMSNorm) == NORMS[model_type]
    assert record.count(FusedSwiGLUMLP) == LAYERS
    assert record.fused_rotary == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert not any("rotary" in note for note in record.left_alone)
    assert isinstance(patched.model.layers[0].mlp, FusedSwiGLUMLP)
    tokens = _tokens(device)
    with torch.no_grad():
        torch.testing.assert_close(patched(tokens).logits, model(tokens).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_patched_logits_match_bfloat16(device, model_type):
    model, patched = _model_and_patched_copy(model_type, device, torch.bfloat16)
    tokens = _tokens(device)
    with torch.no_grad():
        expected = _tiny_model(model_type, device)(tokens).logits  # float32 truth
        ours, theirs = patched(tokens).logits.float(), model(tokens).logits.float()
    # The fused model is no further from the float32 model than Hugging Face's own bf16 run, give or take.
    err_ours, err_theirs = (ours - expected).abs().max(), (theirs - expected).abs().max()
    assert err_ours <= 1.5 * err_theirs + 1e-2
    torch.testing.assert_close(ours, theirs, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_training_with_fused_stack_gives_the_same_losses(device, model_type):
    tokens = _tokens(device, batch=2, seq=12)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def train(model, optimizer, loss_fn):
        losses = []
        for _ in range(4):
            optimizer.zero_grad(set_to_none=True)
            logits = model(inputs).logits
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    model, patched = _model_and_patched_copy(model_type, device)
    theirs = train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), torch.nn.functional.cross_entropy)
    ours = train(patched, FusedAdamW(patched.parameters(), lr=3e-3), cross_entropy)
    assert theirs[-1] < theirs[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5)


def test_patch_keeps_parameters_and_state_dict(device):
    model = _tiny_model("llama", device)
    params_before = [id(p) for p in model.parameters()]
    keys_before = list(model.state_dict())
    patch(model)
    assert [id(p) for p in model.parameters()] == params_before
    assert list(model.state_dict()) == keys_before


def test_patching_twice_changes_nothing_more(device):
    model = _tiny_model("qwen3", device)
    patch(model)
    attention_forward = model.model.layers[0].self_attn.forward
    again = patch(model)
    assert again.replacements == [] and again.fused_rotary == [] and again.left_alone == []
    assert model.model.layers[0].self_attn.forward is attention_forward
    # A second model installs no second dispatcher over the first.
    patch(_tiny_model("qwen3", device))
    function = _modeling("qwen3").apply_rotary_pos_emb
    assert not hasattr(function.__wrapped__, "fuselab_dispatcher")


def test_non_silu_mlp_is_left_alone(device):
    config = transformers.LlamaConfig(**TINY, hidden_act="gelu")
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    record = patch(model)
    assert record.count(FusedSwiGLUMLP) == 0 and record.count(FusedRMSNorm) == NORMS["llama"]
    assert any("hidden_act" in note for note in record.left_alone)


def test_unsupported_models_are_refused():
    with pytest.raises(TypeError, match="model"):
        patch("llama")
    with pytest.raises(ValueError, match="model_type"):
        patch(torch.nn.Linear(2, 2))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="gpt2"):
        patch(gpt2)


def _modeling(model_type):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def _q_k_cos_sin(device, dtype, cos_batch, batch=2, seq=5, q_heads=4, kv_heads=2, head_dim=16):
    """q and k as HF's attention makes them ([B, T, H, D] projections seen as [B, H, T, D]), and the
    cos/sin of its rotary embedding for positions 3, 4, ... (per batch row or shared)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(batch, seq, q_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    positions = (torch.arange(seq) + 3 + torch.arange(cos_batch)[:, None] * 7).double()
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, emb.cos().to(device, dtype), emb.sin().to(device, dtype)


@pytest.mark.parametrize("cos_batch", [2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rotary_matches_hugging_face_function(device, monkeypatch, dtype, cos_batch):
    patch(_tiny_model("llama", device))  # installs the dispatcher
    dispatcher = _modeling("llama").apply_rotary_pos_emb
    q, k, cos, sin = _q_k_cos_sin(device, dtype, cos_batch)
    q.requires_grad_(True)
    k.requires_grad_(True)
    expected_q, expected_k = dispatcher.__wrapped__(q, k, cos, sin)
    calls = _count_rotate_half(monkeypatch, "llama")
    token = _FUSED_ROTARY_ACTIVE.set(True)
    try:
        ours_q, ours_k = dispatcher(q, k, cos, sin)
    finally:
        _FUSED_ROTARY_ACTIVE.reset(token)
    assert calls == []  # the fused path ran
    assert ours_q.stride() == expected_q.stride() and ours_q.dtype == expected_q.dtype
    # HF rounds each product and the sum to the dtype; the kernel rounds once.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours_q, expected_q, **tol)
    torch.testing.assert_close(ours_k, expected_k, **tol)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    expected_grads = torch.autograd.grad((expected_q, expected_k), (q, k), (grad_q, grad_k))
    ours_grads = torch.autograd.grad((ours_q, ours_k), (q, k), (grad_q, grad_k))
    for ours, expected in zip(ours_grads, expected_grads):
        torch.testing.assert_close(ours, expected, **tol)


def test_fused_rotary_in_inference_rotates_in_place_with_each_forwards_own_table(device):
    patch(_tiny_model("llama", device))
    dispatcher = _modeling("llama").apply_rotary_pos_emb
    q, k, cos, sin = _q_k_cos_sin(device, torch.float32, 1)
    token = _FUSED_ROTARY_ACTIVE.set(True)
    try:
        # The same cos/sin twice (two layers of a forward), then new ones (the next forward's): never a stale table.
        for c, s in ((cos, sin), (cos, sin), (sin.clone(), cos.clone())):
            expected = dispatcher.__wrapped__(q, k, c, s)
            q_in, k_in = q.clone(), k.clone()
            with torch.no_grad():
                ours = dispatcher(q_in, k_in, c, s)
            assert ours[0].data_ptr() == q_in.data_ptr() and ours[1].data_ptr() == k_in.data_ptr()
            for a, b in zip(ours, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        _FUSED_ROTARY_ACTIVE.reset(token)


def test_fused_rotary_leaves_what_it_cannot_do_to_hugging_face(device, monkeypatch):
    patch(_tiny_model("llama", device))
    dispatcher = _modeling("llama").apply_rotary_pos_emb
    q, k, cos, sin = _q_k_cos_sin(device, torch.float32, 2)
    calls = _count_rotate_half(monkeypatch, "llama")
    token = _FUSED_ROTARY_ACTIVE.set(True)
    try:
        cases = {
            "float64": (q.double(), k.double(), cos.double(), sin.double()),  # the kernel computes in float32
            "cos/sin want gradients": (q, k, cos.clone().requires_grad_(True), sin),
            "mixed dtypes": (q.bfloat16(), k.bfloat16(), cos, sin),
            "unsqueeze_dim=2": (q.transpose(1, 2), k.transpose(1, 2), cos, sin),
        }
        for name, args in cases.items():
            kwargs = {"unsqueeze_dim": 2} if name == "unsqueeze_dim=2" else {}
            expected = dispatcher.__wrapped__(*args, **kwargs)
            calls.clear()
            ours = dispatcher(*args, **kwargs)
            assert len(calls) == 2, name  # HF's function ran
            for o, e in zip(ours, expected):
                assert torch.equal(o, e), name
    finally:
        _FUSED_ROTARY_ACTIVE.reset(token)


def _count_rotate_half(monkeypatch, model_type):
    """Counts the calls of HF's rotate_half, which only HF's apply_rotary_pos_emb makes."""
    modeling = _modeling(model_type)
    calls = []
    rotate_half = modeling.rotate_half

    def spy(x):
        calls.append(x.shape)
        return rotate_half(x)

    monkeypatch.setattr(modeling, "rotate_half", spy)
    return calls


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
def test_unpatched_model_of_the_same_class_keeps_hugging_face_rotary(device, monkeypatch, model_type):
    model, patched = _model_and_patched_copy(model_type, device)
    calls = _count_rotate_half(monkeypatch, model_type)
    tokens = _tokens(device)
    with torch.no_grad():
        patched(tokens)
        assert calls == []
        model(tokens)
    assert len(calls) == 2 * LAYERS  # q and k, every layer


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
def test_patched_generate_gives_the_same_greedy_tokens(device, model_type):
    model, patched = _model_and_patched_copy(model_type, device)
    tokens = _tokens(device, batch=2, seq=5)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(tokens, attention_mask=torch.ones_like(tokens), **options)
        ours = patched.generate(tokens, attention_mask=torch.ones_like(tokens), **options)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_patched_gradients_match(device, monkeypatch, model_type):
    model, patched = _model_and_patched_copy(model_type, device)
    calls = _count_rotate_half(monkeypatch, model_type)
    tokens = _tokens(device)
    _token_positions.cache_clear()
    with torch.inference_mode():
        patched(tokens)  # positions kept from an inference-mode step are still fine to save for backward
    for m in (model, patched):
        m(tokens).logits.float().square().mean().backward()
    assert len(calls) == 2 * LAYERS  # the unpatched model's only: the patched one's went through apply_rope
    grads = dict(patched.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_copy_of_patched_model_runs_its_own_attention(device):
    patched = _tiny_model("llama", device)
    patch(patched)
    copied = copy.deepcopy(patched)
    attention = copied.model.layers[0].self_attn
    assert attention.forward.forward.__self__ is attention
    tokens = _tokens(device)
    with torch.no_grad():
        torch.testing.assert_close(copied(tokens).logits, patched(tokens).logits)


def test_rotary_left_alone_without_hugging_face_function(device, monkeypatch):
    monkeypatch.delattr(_modeling("llama"), "apply_rotary_pos_emb")
    record = patch(_tiny_model("llama", device))
    assert record.fused_rotary == [] and record.count(FusedRMSNorm) == NORMS["llama"]
    assert [note for note in record.left_alone if "rotary" in note] == [
        "rotary embedding of LlamaAttention left as Hugging Face's: "
        "transformers.models.llama.modeling_llama has no apply_rotary_pos_emb"
    ]


def test_rotary_left_alone_when_attention_does_not_call_it(device, monkeypatch):
    attention_class = _modeling("llama").LlamaAttention
    forward = attention_class.forward
    monkeypatch.setattr(attention_class, "forward", lambda self, *args, **kwargs: forward(self, *args, **kwargs))
    model = _tiny_model("llama", device)
    record = patch(model)
    assert record.fused_rotary == []
    assert any("LlamaAttention.forward does not call apply_rotary_pos_emb" in note for note in record.left_alone)
    with torch.no_grad():
        model(_tokens(device))
