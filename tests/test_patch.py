import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fuselab.kernels import cross_entropy  # noqa: E402
from fuselab.optim import FusedAdamW  # noqa: E402
from fuselab.patching import FusedRMSNorm, FusedSwiGLUMLP, patch  # noqa: E402

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


def _tokens(device, batch=2, seq=9):
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_patched_logits_match_float32(device, model_type):
    model = _tiny_model(model_type, device)
    patched = copy.deepcopy(model)
    record = patch(patched)
    assert record.count(FusedRMSNorm) == NORMS[model_type]
    assert record.count(FusedSwiGLUMLP) == LAYERS
    assert any("rotary" in note for note in record.left_alone)
    assert isinstance(patched.model.layers[0].mlp, FusedSwiGLUMLP)
    tokens = _tokens(device)
    with torch.no_grad():
        torch.testing.assert_close(patched(tokens).logits, model(tokens).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_patched_logits_match_bfloat16(device, model_type):
    model = _tiny_model(model_type, device, torch.bfloat16)
    patched = copy.deepcopy(model)
    patch(patched)
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

    model = _tiny_model(model_type, device)
    patched = copy.deepcopy(model)
    patch(patched)
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
    assert patch(model).replacements == []


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
