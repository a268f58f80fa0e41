import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuselab import optim as optim_module
from fuselab.kernels import reference
from fuselab.optim import FusedAdamW

SHAPES = [(1,), (3,), (1000,), (37, 129), (5003,)]
SMALL_BLOCK = 256  # several tiles per parameter, and ragged last tiles


@pytest.fixture(autouse=True)
def small_block(monkeypatch):
    monkeypatch.setattr(optim_module, "BLOCK", SMALL_BLOCK)


def _params(shapes, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).to(device) for shape in shapes]


def _grads(params, step, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype).to(p.device) for p in params]


def _run(optimizer_cls, params, steps, lr_schedule=None, **hyper):
    params = [p.clone().requires_grad_(True) for p in params]
    opt = optimizer_cls(params, **hyper)
    for step in range(steps):
        if lr_schedule:
            opt.param_groups[0]["lr"] = lr_schedule[step]
        for p, g in zip(params, _grads(params, step)):
            p.grad = g  # a new gradient tensor each step: its address moves
        opt.step()
    return params, opt


@pytest.mark.parametrize(
    "hyper",
    [
        dict(lr=1e-2),
        dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        dict(lr=1e-2, weight_decay=0.0, maximize=True),
    ],
)
def test_float32_matches_torch_adamw(device, hyper):
    params = _params(SHAPES, torch.float32, device)
    ours, _ = _run(FusedAdamW, params, steps=3, lr_schedule=[hyper["lr"], hyper["lr"] / 2, hyper["lr"] / 4], **hyper)
    theirs, _ = _run(torch.optim.AdamW, params, steps=3, lr_schedule=[hyper["lr"], hyper["lr"] / 2, hyper["lr"] / 4], **hyper)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_params_update_a_float32_master(device, dtype):
    start = _params(SHAPES[:4], dtype, device)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    params, opt = _run(FusedAdamW, start, steps=3, **hyper)
    for i, (p0, p) in enumerate(zip(start, params)):
        expected, m, v = p0.double(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
        for step in range(3):
            grad = _grads(start, step)[i]
            expected, m, v = reference.adamw_step(expected, grad.double(), m, v, step + 1, **hyper)
        state = opt.state[p]
        assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(state["master"].double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["exp_avg_sq"].double(), v, rtol=1e-5, atol=1e-8)
        # The parameter is the master rounded to its dtype (within one ulp: the interpreter truncates).
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(p.detach().float(), state["master"], rtol=ulp, atol=0)


def test_groups_with_their_own_hyperparameters(device):
    a, b = _params([(300,), (70,)], torch.float32, device)
    groups = lambda x, y: [dict(params=[x], lr=1e-2), dict(params=[y], lr=1e-3, weight_decay=0.0)]  # noqa: E731
    ours = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    theirs = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    opt_ours, opt_theirs = FusedAdamW(groups(*ours)), torch.optim.AdamW(groups(*theirs))
    for step in range(2):
        for ps in (ours, theirs):
            for p, g in zip(ps, _grads(ps, step)):
                p.grad = g
        opt_ours.step()
        opt_theirs.step()
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_params_without_gradient_are_left_alone(device):
    a, b = (p.requires_grad_(True) for p in _params([(500,), (40,)], torch.float32, device))
    b_before = b.detach().clone()
    opt = FusedAdamW([a, b], lr=0.1)
    a.grad = torch.ones_like(a)
    opt.step()
    assert torch.equal(b.detach(), b_before) and not torch.equal(a.detach(), torch.zeros_like(a))
    a.grad = None
    opt.step()  # no gradient at all: nothing moves, the count does not advance
    assert opt.param_groups[0]["step"] == 1


def test_replaced_parameter_storage_is_picked_up(device):
    (p,) = _params([(600,)], torch.float32, device)
    p.requires_grad_(True)
    opt = FusedAdamW([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.ones_like(p)
    opt.step()
    p.data = torch.zeros(600, device=device)  # new storage: the address table must follow it
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.all(p.detach() < 0)


def test_state_dict_round_trip_continues_the_same_run(device):
    params = _params([(700,), (9,)], torch.float32, device)
    straight, _ = _run(FusedAdamW, params, steps=4, lr=1e-2)
    first, opt = _run(FusedAdamW, params, steps=2, lr=1e-2)
    resumed = [p.detach().clone().requires_grad_(True) for p in first]
    opt2 = FusedAdamW(resumed, lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    for step in range(2, 4):
        for p, g in zip(resumed, _grads(resumed, step)):
            p.grad = g
        opt2.step()
    for a, b in zip(resumed, straight):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_training_a_small_model_gives_torch_adamw_losses(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4)).to(device)
    twin = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    x, y = torch.randn(32, 16, device=device), torch.randn(32, 4, device=device)

    def losses(opt, forward, params):
        out = []
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(forward(params), y)
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    def forward(ps):
        w1, b1, w2, b2 = ps
        return torch.tanh(x @ w1.T + b1) @ w2.T + b2

    ours = losses(FusedAdamW(model.parameters(), lr=1e-2), lambda _: model(x), None)
    theirs = losses(torch.optim.AdamW(twin, lr=1e-2), forward, twin)
    assert ours[-1] < ours[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6)


def test_closure_is_called_with_grad_enabled(device):
    (p,) = _params([(10,)], torch.float32, device)
    p.requires_grad_(True)
    opt = FusedAdamW([p])

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure) > 0


def test_empty_parameter(device):
    p = torch.empty(0, device=device, requires_grad=True)
    q = torch.ones(5, device=device, requires_grad=True)
    opt = FusedAdamW([p, q], lr=0.1)
    p.grad, q.grad = torch.empty(0, device=device), torch.ones(5, device=device)
    opt.step()
    assert torch.all(q.detach() < 1)


def test_bad_arguments(device):
    (p,) = _params([(8,)], torch.float32, device)
    for kw, name in [(dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"), (dict(eps=-1.0), "eps"), (dict(weight_decay=-0.1), "weight_decay")]:
        with pytest.raises(ValueError, match=name):
            FusedAdamW([p], **kw)
    cases = [
        (torch.zeros(4, dtype=torch.float64, device=device), None, TypeError, "float32"),
        (torch.zeros(4, 6, device=device).T, None, ValueError, "contiguous"),
        (torch.zeros(4, 8, device=device), torch.zeros(8, 4, device=device).T, ValueError, "gradient"),
    ]
    for param, grad, error, message in cases:
        param.grad = grad if grad is not None else torch.zeros_like(param)
        with pytest.raises(error, match=message):
            FusedAdamW([param]).step()


@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.integers(1, 1200), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_random_sizes_match_torch_adamw(sizes, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = _params([(n,) for n in sizes], torch.float32, device, seed=seed)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(optim_module, "BLOCK", 128)
        ours, _ = _run(FusedAdamW, params, steps=2, lr=1e-2, weight_decay=0.1)
    theirs, _ = _run(torch.optim.AdamW, params, steps=2, lr=1e-2, weight_decay=0.1)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
