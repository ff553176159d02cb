"""The assertions library: each library assertion trips on its program and stays quiet on
healthy ones; custom assertions of every kind; the CLI stops with reason 'assertion'."""
from __future__ import annotations

import runpy

import pytest
import torch
import torch.nn as nn

import mldebug
from mldebug.assertions import registry as _registry
from mldebug.assertions.runner import Runner, active_runner

from conftest import REPO, marker_line, read_report, run_cli

PROGRAMS = REPO / "tests" / "programs_assert"
EXAMPLES = REPO / "examples"

# library assertion -> (program, stage of the Stop)
TRIPS = {
    "grad_not_zeroed": ("grad_not_zeroed.py", "optimizer"),
    "loss_not_scalar": ("loss_not_scalar.py", "backward"),
    "loss_requires_no_grad": ("loss_requires_no_grad.py", "backward"),
    "exploding_gradients": ("exploding_gradients.py", "backward"),
    "param_no_grad": ("param_no_grad.py", "optimizer"),
    "dead_relu": ("dead_relu.py", "forward"),
    "vanishing_gradients": ("vanishing_gradients.py", "backward"),
    "param_not_updated": ("param_not_updated.py", "optimizer"),
    "update_ratio": ("update_ratio.py", "optimizer"),
    "saturated_activation": ("saturated_activation.py", "forward"),
    "activation_scale": ("activation_scale.py", "forward"),
}


@pytest.fixture(autouse=True)
def fresh_registry():
    """Every test starts from the default library and leaves no trace behind."""
    saved, loaded = list(_registry._REGISTRY), _registry._LOADED
    _registry._REGISTRY.clear()
    _registry._LOADED = False
    yield
    _registry._REGISTRY[:] = saved
    _registry._LOADED = loaded
    _registry.VERSION[0] += 1
    assert active_runner() is None


def run_program(path, runner_kwargs=None):
    """Run PATH as __main__ in this process under the always-on runner; returns the
    violations reported (each would be a stop)."""
    stops = []
    with Runner(on_violation=stops.append, **(runner_kwargs or {})) as runner:
        runpy.run_path(str(path), run_name="__main__")
    return stops, runner


@pytest.mark.parametrize("name", sorted(TRIPS))
def test_each_library_assertion_trips_on_its_program(name):
    program, stage = TRIPS[name]
    path = PROGRAMS / program
    stops, _ = run_program(path)
    assert stops, f"{name} did not trip"
    first = stops[0]
    assert first.assertion == name, [v.headline() for v in stops]
    assert first.kind == "assertion"
    assert first.stage == stage
    assert first.file == str(path)
    assert first.line == marker_line(path)
    assert first.frame is not None and first.frame.f_code.co_filename == str(path)
    a = _registry.get(name)
    assert a.message in first.text and a.hint in first.text
    if name == "exploding_gradients":
        assert first.step == 6                  # the step with the 1e6-scaled loss
    if name == "param_no_grad":
        assert first.param.startswith("extra.") and first.step == 9   # tenth step


@pytest.mark.parametrize("path", [PROGRAMS / "healthy.py", EXAMPLES / "healthy.py",
                                  REPO / "tests" / "programs" / "healthy_train.py"],
                         ids=lambda p: p.parent.name + "/" + p.name)
def test_healthy_programs_trip_no_default_assertion(path):
    stops, runner = run_program(path)
    assert [v.headline() for v in stops] == []
    assert runner.step > 0


def test_forgot_zero_grad_example_trips_grad_not_zeroed():
    path = EXAMPLES / "forgot_zero_grad.py"
    stops, _ = run_program(path)
    first = stops[0]
    assert first.assertion == "grad_not_zeroed"
    assert first.line == marker_line(path, "optimizer.step()")
    assert first.step == 1
    assert first.param == "0.weight" and first.module == "0"


def test_each_stop_happens_once_per_target_but_is_recorded_each_time():
    stops, runner = run_program(EXAMPLES / "forgot_zero_grad.py")
    assert len(stops) == 1
    assert len([v for v in runner.violations if v.assertion == "grad_not_zeroed"]) == 29


def test_opt_in_assertions_are_off_by_default():
    off = {a.name for a in mldebug.assertions() if not a.enabled}
    assert off == {"vanishing_gradients", "param_not_updated", "update_ratio",
                   "saturated_activation", "activation_scale"}
    stops, _ = run_program(PROGRAMS / "healthy.py")
    assert stops == []


def test_gan_style_cross_accumulation_is_not_a_forgotten_zero_grad():
    torch.manual_seed(0)
    G, D = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 1))
    og, od = torch.optim.SGD(G.parameters(), lr=0.01), torch.optim.SGD(D.parameters(), lr=0.01)
    stops = []
    with Runner(on_violation=stops.append):
        for _ in range(4):
            od.zero_grad()
            D(torch.randn(8, 4)).mean().backward()
            od.step()
            og.zero_grad()
            D(G(torch.randn(8, 4))).mean().backward()   # also accumulates into D's grads
            og.step()
    assert [v.assertion for v in stops] == []


@pytest.mark.parametrize("idiom", ["zeroed through .data", "halved through .data"])
def test_a_gradient_written_where_its_version_counter_does_not_see_is_judged_by_its_values(
        idiom):
    # `p.grad.data.zero_()` (an old idiom) moves no version counter: the gradients are
    # zero, as after zero_grad(), and adding to zeros is no accumulation; halved, the
    # last step's gradient is still in the sum
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stops = []
    with Runner(on_violation=stops.append):
        for _ in range(4):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            for p in model.parameters():
                if idiom == "zeroed through .data":
                    p.grad.data.zero_()
                else:
                    p.grad.data.mul_(0.5)
    expected = [] if idiom == "zeroed through .data" else ["grad_not_zeroed"]
    assert [v.assertion for v in stops] == expected


def test_a_gradient_that_is_zero_most_steps_is_measured_against_the_steps_it_moved():
    # a WGAN critic's bias gets exactly 0 while the loss is a difference of means; a
    # hinge loss's gradient is 0 on the batches it gets right: no history to jump above
    torch.manual_seed(0)
    critic = nn.Linear(4, 1)
    opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    real, fake = torch.randn(8, 4) + 1, torch.randn(8, 4)
    stops = []
    with Runner(on_violation=stops.append):
        for step in range(8):
            loss = critic(fake).mean() - critic(real).mean()
            if step >= 4:          # a drift penalty switched on: the bias moves now
                loss = loss + 0.1 * critic(real).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [v.assertion for v in stops] == []


def test_sparse_gradients_are_no_trouble_for_the_gradient_assertions():
    import warnings
    torch.manual_seed(0)
    emb, head = nn.Embedding(50, 8, sparse=True), nn.Linear(8, 2)
    opt_s = torch.optim.SparseAdam(emb.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(head.parameters(), lr=1e-2)
    ids, y = torch.randint(0, 50, (16, 5)), torch.randint(0, 2, (16,))
    stops = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Runner(on_violation=stops.append):
            for _ in range(5):
                loss = nn.functional.cross_entropy(head(emb(ids).mean(1)), y)
                opt_s.zero_grad()
                opt_d.zero_grad()
                loss.backward()
                opt_s.step()
                opt_d.step()
    assert stops == []
    assert [str(w.message) for w in caught if "mldebug" in str(w.message)] == []


def test_a_layer_skipped_at_random_is_no_layer_without_a_gradient():
    # LayerDrop: each layer skipped with p = 0.5; a layer that a seed skips 3 steps in a
    # row (steps 2-4 here) still learns. A layer never used stops (the trips above)
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
    inp, out = nn.Linear(8, 16), nn.Linear(16, 3)
    opt = torch.optim.Adam([*inp.parameters(), *layers.parameters(), *out.parameters()],
                           lr=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    coin = torch.Generator().manual_seed(1)
    stops, skipped = [], []
    with Runner(on_violation=stops.append):
        for _ in range(20):
            drop = (torch.rand(4, generator=coin) < 0.5).tolist()
            skipped.append(drop)
            h = inp(x)
            for layer, dropped in zip(layers, drop):
                if not dropped:
                    h = h + torch.tanh(layer(h))
            loss = nn.functional.cross_entropy(out(h), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    runs = max(max(len(r) for r in "".join("x" if s[i] else "." for s in skipped).split("."))
               for i in range(4))
    assert runs >= 3, skipped          # (the case this test is about)
    assert [v.assertion for v in stops] == []


def test_custom_assertions_of_every_kind():
    path = PROGRAMS / "custom_kinds.py"
    stops, runner = run_program(path)
    by_name = {}
    for v in stops:
        by_name.setdefault(v.assertion, v)
    assert {"custom_loss_below_1", "custom_param_small_grad", "custom_tensor_node",
            "custom_function", "custom_module", "custom_function_node",
            "custom_python_function"} <= set(by_name)
    assert by_name["custom_loss_below_1"].stage == "backward"
    assert by_name["custom_param_small_grad"].param.endswith(".bias")
    assert by_name["custom_tensor_node"].node == "1#0"
    assert by_name["custom_tensor_node"].module == "1"
    assert by_name["custom_module"].module in ("0", "2")
    assert by_name["custom_module"].module_type == "Linear"
    assert by_name["custom_function_node"].node == "1#0"
    py = by_name["custom_python_function"]          # a user's Python function as target
    assert py.stage == "forward" and py.line == marker_line(path, "# python function")
    # node and function assertions also ran after backward, with the gradients
    follow = _registry.get("custom_tensor_node")
    assert ("backward", "1#0", True) in follow.seen
    softmax = _registry.get("custom_function")
    assert ("backward", ["input 0", "output"]) in softmax.seen
    assert ("forward", []) in softmax.seen


def test_register_deregister_and_switch():
    class Never(mldebug.assertions.TensorAssertion):
        name = "never"

        def check(self, tensor, grad=None):
            return False

    a = mldebug.register_assertion(Never)
    assert a in mldebug.assertions()
    again = mldebug.register_assertion(Never())         # same name: replaced
    assert [x.name for x in mldebug.assertions()].count("never") == 1
    assert mldebug.deregister_assertion(Never) == [again]
    with pytest.raises(mldebug.UsageError):
        mldebug.deregister_assertion("never")
    with pytest.raises(mldebug.UsageError):
        mldebug.register_assertion(object())
    mldebug.assertions.set_enabled("dead_relu", False)
    stops, _ = run_program(PROGRAMS / "dead_relu.py")
    assert [v.assertion for v in stops] == []


def test_a_check_that_raises_is_switched_off_with_a_warning():
    class Broken(mldebug.assertions.TensorAssertion):
        name = "broken"

        def check(self, tensor, grad=None):
            raise ZeroDivisionError("oops")

    mldebug.register_assertion(Broken)
    with pytest.warns(RuntimeWarning, match="broken"):
        stops, _ = run_program(PROGRAMS / "healthy.py")
    assert stops == [] and not _registry.get("broken").enabled


def test_runner_close_restores_backward_and_hooks():
    orig = torch.autograd.backward
    r = Runner(on_violation=lambda v: None).start()
    assert torch.autograd.backward is not orig
    r.close()
    r.close()
    assert torch.autograd.backward is orig
    from mldebug.graph import active_capture
    assert active_capture() is None


def test_runner_closes_when_the_program_raises():
    orig = torch.autograd.backward
    with pytest.raises(ValueError):
        with Runner(on_violation=lambda v: None):
            raise ValueError("boom")
    assert torch.autograd.backward is orig


def test_scan_captures_one_step_and_runs_the_assertions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    stops = []
    with mldebug.scan(on_violation=stops.append) as s:
        loss = model(x).squeeze(1)          # not reduced: a vector 'loss'
        try:
            loss.backward()
        except RuntimeError:
            pass
        loss.sum().backward()
        opt.step()
    assert [v.assertion for v in stops] == ["loss_not_scalar"]
    g = s.graph
    assert [n.id for n in g.modules()] == ["root#0", "0#0", "1#0", "2#0"]
    assert "linear" in g["0"].ops
    assert g["2"].grads and g["2"].grads[0] > 0     # gradient reaching the output
    assert torch.autograd.backward.__module__ == "torch.autograd"


# -- through the real CLI -------------------------------------------------------------
@pytest.mark.parametrize("name", ["grad_not_zeroed", "dead_relu", "loss_requires_no_grad"])
def test_cli_batch_stops_on_the_assertion(tmp_path, name):
    program = PROGRAMS / TRIPS[name][0]
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(program)])
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert stop["reason"] == "assertion"
    assert stop["assertion"] == name
    assert stop["file"] == str(program)
    assert stop["line"] == marker_line(program)
    assert stop["stage"] == TRIPS[name][1]
    assert f"assertion {name} failed" in stop["message"]


def test_cli_forgot_zero_grad_example(tmp_path):
    example = EXAMPLES / "forgot_zero_grad.py"
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(example)])
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["assertion"]) == ("assertion", "grad_not_zeroed")
    assert stop["line"] == marker_line(example, "optimizer.step()")
    assert stop["param"] == "0.weight"


def test_cli_break_on_without_assert_runs_through(tmp_path):
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--break-on", "nan,inf", "--report", str(report),
                      str(EXAMPLES / "forgot_zero_grad.py")])
    assert result.returncode == 0, result.stderr
    assert read_report(report) == []


def test_cli_interactive_stop_then_assertions_command_and_switch_off():
    program = PROGRAMS / "grad_not_zeroed.py"
    result = run_cli([str(program)],
                     stdin="assertions\nassertions off grad_not_zeroed\nassertions off nope\n"
                           "assertions on update_ratio\nassertions on\nc\n")
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert "mldebug: assertion grad_not_zeroed failed" in out
    assert f"> {program}({marker_line(program)})<module>()" in out
    assert "grad_not_zeroed [param" in out and "update_ratio [param" in out
    assert "violations this step (1):" in out
    assert "assertion grad_not_zeroed is off" in out
    assert "no assertion named 'nope'" in out
    assert "assertion update_ratio is on" in out
    assert "usage: assertions [on NAME | off NAME]" in out
    # switched off, grad_not_zeroed does not stop again; update_ratio, now on, finds
    # SGD's lr=0.01 fine: the program runs to its end
    assert result.stdout.count("mldebug: assertion") == 1


def test_scan_inside_the_always_on_runner_reports_once():
    model = nn.Linear(4, 1)
    outer = []
    with Runner(on_violation=outer.append):
        inner = []
        with mldebug.scan(on_violation=inner.append) as s:
            with torch.no_grad():
                loss = model(torch.randn(2, 4)).sum()
            try:
                loss.backward()
            except RuntimeError:
                pass
        assert [v.assertion for v in inner] == ["loss_requires_no_grad"]
        assert s.graph is not None and s.graph.root_type == "Linear"
    assert outer == []


def test_python_function_target_is_wrapped_and_restored(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("mldebug_test_fn_module")
    exec("def double(x):\n    return x * 2\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    original = mod.double

    class Small(mldebug.assertions.FunctionAssertion):
        name = "small_output"

        def check(self, output, inputs, grads):
            return float(output.max()) < 5

    stops = []
    with Runner(on_violation=stops.append):
        mldebug.register_assertion(Small(targets=[original]))
        assert mod.double is not original and mod.double.__wrapped__ is original
        mod.double(torch.ones(2))
        mod.double(torch.full((2,), 4.0))
    assert mod.double is original
    assert [v.assertion for v in stops] == ["small_output"]


def test_dead_relu_does_not_call_nan_units_dead():
    """After a NaN stop and `c`, NaN weights make NaN ReLU outputs: broken, not dead (the
    watch reports NaN); units that are really never positive still count."""
    a = _registry.get("dead_relu")
    relu = nn.ReLU()
    nan_out = torch.full((32, 16), float("nan"))
    assert a.check(relu, nan_out, (), None)
    half_dead = torch.randn(32, 16).abs()
    half_dead[:, :10] = 0.0
    half_dead[:, 10:] = float("nan")       # 10 of the 16 units are dead, 6 are NaN
    assert not a.check(relu, half_dead, (), None)
    assert "62% of 16 units dead" in a.detail


def test_a_custom_param_assertion_without_detail_counts_the_other_parameters():
    """Several parameters fail one check: the text names the count, without the empty
    detail's separator ('(; 1 more ...)')."""
    import torch
    import torch.nn as nn

    import mldebug
    from mldebug.assertions import ParamAssertion

    class WeightTooBig(ParamAssertion):
        name = "weight_too_big_test"
        message = "a weight's abs-max exceeds 10"
        check_on = ("optimizer",)

        def check(self, name, param, grad):
            return param.detach().abs().max().item() <= 10

    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(20.0)
        model.bias.fill_(20.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    got = []
    mldebug.register_assertion(WeightTooBig())
    try:
        with mldebug.scan(on_violation=got.append):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    finally:
        mldebug.deregister_assertion("weight_too_big_test")
    texts = [v.text for v in got if v.assertion == "weight_too_big_test"]
    assert texts == ["a weight's abs-max exceeds 10 (1 more parameter(s))"]
