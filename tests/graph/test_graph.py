"""Graph capture: trace() on real third-party models (GPT-2 from transformers, a CNN),
the awkward cases (kwargs, ModelOutput, in-place ops, tensors that bypass modules, a
module called twice, a model that raises), exports, the always-on capture, and the
`graph` command through the real CLI."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mldebug
from mldebug import graph as G

from conftest import marker_line, run_cli


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.bn(self.conv(x))
        out += x                       # in-place residual add
        return self.relu(out)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Block(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.block(self.block(self.stem(x)))      # the same block called twice
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def test_trace_gpt2_modules_ids_shapes_and_model_output(gpt2):
    ids = torch.randint(0, 100, (2, 8))
    g = mldebug.trace(gpt2, input_ids=ids, labels=ids)        # keyword tensors
    assert isinstance(g, mldebug.Graph) and g.complete and not g.error
    root = g["root"]
    assert root.type == "GPT2LMHeadModel" and root.id == "root#0"
    # ModelOutput (a dict/dataclass): the loss and the logits
    assert ((), "f32") in root.outputs and ((2, 8, 100), "f32") in root.outputs
    assert root.inputs and root.inputs[0] == ((2, 8), "i64")   # input_ids came as a kwarg
    for path in ("transformer.wte", "transformer.h.0.attn", "transformer.h.1.mlp.c_fc",
                 "transformer.ln_f", "lm_head"):
        assert g.find(path) is not None, path
    assert g["transformer.h.0.attn"].type == "GPT2Attention"
    assert g["lm_head"].outputs == (((2, 8, 100), "f32"),)
    assert g["transformer.h.0"].parent == "transformer#0"
    assert "transformer.h.0#0" in g["transformer"].children
    # op-level detail and producer -> consumer edges
    ops = [n for n in g if n.kind == "op"]
    assert any(n.type in ("softmax", "scaled_dot_product_attention", "matmul") for n in ops)
    into_lm_head = [src for src, dst in g.edges if dst == "lm_head#0"]
    assert into_lm_head == ["/__getitem__#0"]          # hidden_states[:, slice] at the root
    assert any(src == "transformer.ln_f#0" for src, _ in g.edges)
    assert ("transformer.h.0.ln_1#0", "transformer.h.0.attn#0") in g.edges
    summaries = g["lm_head"].summaries()
    assert summaries[0].shape == (2, 8, 100) and summaries[0].nonfinite == 0


def test_gpt2_node_ids_are_stable_across_calls(gpt2):
    ids = torch.randint(0, 100, (2, 8))
    a = mldebug.trace(gpt2, ids)
    b = mldebug.trace(gpt2, torch.randint(0, 100, (2, 8)))
    assert list(a.nodes) == list(b.nodes)


def test_trace_cnn_inplace_twice_called_and_bypassing_tensors():
    torch.manual_seed(0)
    model = CNN()
    g = mldebug.trace(model, torch.randn(2, 3, 8, 8))
    assert [n.id for n in g.modules()] == [
        "root#0", "stem#0", "block#0", "block.conv#0", "block.bn#0", "block.relu#0",
        "block#1", "block.conv#1", "block.bn#1", "block.relu#1", "fc#0"]
    assert g["block#1"].index == 1
    # the in-place residual add is an op node marked in-place, consuming bn's output
    iadd = [n for n in g if n.kind == "op" and n.inplace and n.parent == "block#0"]
    assert iadd, [n.id for n in g if n.kind == "op"]
    assert ("block.bn#0", iadd[0].id) in g.edges
    assert (iadd[0].id, "block.relu#0") in g.edges
    # tensors that bypass modules: pooling/flatten are ops at the root, feeding fc
    flatten = g.find("/flatten#0")
    assert flatten is not None and flatten.parent == "root#0"
    assert (flatten.id, "fc#0") in g.edges
    assert ("block#0", "block#1") in g.edges


def test_module_level_trace_without_ops():
    g = mldebug.trace(CNN(), torch.randn(1, 3, 8, 8), ops=False)
    assert all(n.kind == "module" for n in g)
    assert ("stem#0", "block#0") in g.edges


def test_a_nested_tensor_is_traced_with_its_ragged_dimensions():
    import warnings
    nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = mldebug.trace(nn.Linear(8, 4), nested)
    assert [str(w.message) for w in caught if "mldebug" in str(w.message)] == []
    ops = [n for n in g if n.kind == "op"]
    assert ops and ops[0].inputs[0] == ((-1, -1, -1), "f32"), [n.inputs for n in ops]


@dataclass
class Out:
    logits: torch.Tensor
    extra: tuple


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, *, scale):
        y = self.lin(x) * scale
        return {"out": Out(y, (y.sum(), y.mean()))}


def test_dict_and_dataclass_outputs_and_keyword_tensor():
    g = mldebug.trace(DictModel(), torch.randn(2, 4), scale=torch.tensor(2.0))
    assert g["root"].outputs == (((2, 3), "f32"), ((), "f32"), ((), "f32"))
    assert ((), "f32") in g["root"].inputs          # the keyword tensor


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.ReLU(), nn.Linear(5, 2))

    def forward(self, x):
        return self.inner(self.a(x))


def test_model_that_raises_keeps_partial_graph_and_exception():
    with pytest.raises(RuntimeError) as info:
        mldebug.trace(Raises(), torch.randn(2, 4))
    exc = info.value
    assert "mat1 and mat2 shapes cannot be multiplied" in str(exc)
    assert type(exc) is RuntimeError
    g = exc.mldebug_graph
    assert g.failing().id == "inner.1#0"
    assert g["inner"].error and not g["inner"].failing
    assert g["a"].outputs == (((2, 4), "f32"),) and not g["a"].error
    assert not g.complete and "RuntimeError" in g.error
    text = g.format()
    assert "<-- raised RuntimeError" in text
    assert '"inner.1#0" [label=' in g.to_dot() and "color=red" in g.to_dot()


def test_to_dict_json_and_dot_and_format():
    g = mldebug.trace(CNN(), torch.randn(1, 3, 8, 8))
    d = json.loads(g.to_json())
    assert {n["id"] for n in d["nodes"]} == set(g.nodes)
    assert d["edges"] and all(len(e) == 2 for e in d["edges"])
    with_stats = g.to_dict(stats=True)
    assert with_stats["nodes"][0]["summaries"][0]["shape"] == [1, 10]
    dot = g.to_dot()
    assert dot.startswith("digraph mldebug {") and dot.rstrip().endswith("}")
    assert '"stem#0" -> "block#0";' in dot
    assert dot.count("{") == dot.count("}")
    text = g.format(depth=1)
    assert "block#1" in text and "block.conv" not in text
    assert "block.conv" in g.format(path="block")
    with pytest.raises(ValueError, match="depth must be >= 0, depth=-1"):
        g.format(depth=-1)


def test_always_on_capture_keeps_the_last_pass_and_closes():
    torch.manual_seed(0)
    model, loss_fn = CNN(), nn.CrossEntropyLoss()
    with G.Capture() as cap:
        assert G.active_capture() is cap
        for step in range(2):
            cap.step = step
            out = model(torch.randn(2, 3, 8, 8))
            loss_fn(out, torch.tensor([1, 2]))
        g = cap.show()                    # the model, not the loss module called last
        assert g.root_type == "CNN" and g.step == 1 and g.complete
        assert cap.last.root_type == "CrossEntropyLoss"
        assert G.last_graph() is g
        assert g["fc"].summaries()[0] is not None    # `out` is alive
        assert [n.id for n in g.modules()][:3] == ["root#0", "stem#0", "block#0"]
    assert G.active_capture() is None
    cap.close()
    assert not torch.nn.modules.module._global_forward_pre_hooks or all(
        getattr(h, "__self__", None) is not cap
        for h in torch.nn.modules.module._global_forward_pre_hooks.values())


def test_always_on_capture_attaches_graph_to_exception():
    with G.Capture():
        with pytest.raises(RuntimeError) as info:
            Raises()(torch.randn(2, 4))
    assert info.value.mldebug_graph.failing().id == "inner.1#0"


GRAPH_PROGRAM = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                          nn.Linear(8, 2))
    x = torch.randn(3, 4)
    y = model(x)
    breakpoint()  # here
    print("done")
"""


def test_graph_command_transcript(write_program):
    prog = write_program(GRAPH_PROGRAM)
    result = run_cli([str(prog)], stdin="graph\ngraph -d 0\ngraph 2\ngraph model(x)\n"
                                         "graph nope\ngraph -d x\nc\n")
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert f"> {prog}({marker_line(prog) + 1})<module>()" in out
    assert "graph of Sequential (complete): 7 module calls" in out
    lines = out.splitlines()
    root_row = next(l for l in lines if l.startswith("(root)  "))
    assert "[3, 2] f32" in root_row and "x∈[" in root_row
    assert any(l.strip().startswith("2.0 ") and "Linear" in l for l in lines)
    assert "(root) (+4)" in out                      # depth 0 hides four children
    assert any(l.startswith("2  ") and "Sequential" in l for l in lines)   # graph 2
    assert any("linear" in l and "[3, 8] f32" in l for l in lines)          # traced ops
    assert "*** graph: no module 'nope'" in out
    assert "*** graph: -d takes a depth >= 0" in out
    assert "done" in out


def test_graph_command_marks_the_assertion_and_the_failing_node(write_program):
    prog = write_program("""
        import torch
        from torch import nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        with torch.no_grad():
            model[0].bias.fill_(-5.0)
        out = model(torch.randn(64, 16))  # here
    """)
    result = run_cli([str(prog)], stdin="graph\nc\n")
    out = result.stdout
    assert "assertion dead_relu failed" in out
    relu_row = next(l for l in out.splitlines() if l.startswith("  1 ") and "ReLU" in l)
    assert "! dead_relu" in relu_row
    assert "(running)" in out            # the pause is inside the forward pass


@pytest.mark.parametrize("mode", ["on", "exact"])
def test_graph_command_at_a_nan_stop_marks_the_module_in_progress(write_program, mode):
    """With `--watch exact`, and in the first calls while the watch learns its roots,
    the stop is inside Bad's log: the pass is in progress and Bad is still running.
    Once the roots are known (the default, from a root's second call) the Sequential's
    output is checked when it returns and its re-run makes the stop: the graph is
    complete and holds Bad's output (all NaN)."""
    prog = write_program("""
        import torch
        from torch import nn

        class Bad(nn.Module):
            shift = -10.0

            def forward(self, x):
                return torch.log(x - self.shift)  # here

        model = nn.Sequential(nn.Linear(4, 4), Bad(), nn.Linear(4, 1))
        x = torch.randn(3, 4)
        model(x)
        model(x)
        Bad.shift = 10.0
        y = model(x)
    """)
    result = run_cli(["--watch", mode, str(prog)], stdin="graph\nq\n")
    out = result.stdout
    assert f"> {prog}({marker_line(prog)})forward()" in out
    bad_row = next(l for l in out.splitlines() if l.startswith("  1 ") and "Bad" in l)
    if mode == "exact":
        assert "graph of Sequential (in progress): 3 module calls" in out
        assert "NaN/Inf!" in bad_row and "(running)" in bad_row
        linear_row = next(l for l in out.splitlines() if l.startswith("  0 "))
        assert "[3, 4] f32" in linear_row and "x∈[" in linear_row
    else:
        assert "graph of Sequential (complete): 4 module calls" in out
        assert "[3, 4] f32" in bad_row and "NaN!12" in bad_row and "NaN/Inf!" in bad_row


def test_always_on_capture_recovers_after_a_base_exception_in_forward():
    class Interrupt(nn.Module):
        armed = True

        def forward(self, x):
            if self.armed:
                raise KeyboardInterrupt
            return x

    model = nn.Sequential(nn.Linear(2, 2), Interrupt())
    with G.Capture() as cap:
        with pytest.raises(KeyboardInterrupt):
            model(torch.randn(1, 2))
        model[1].armed = False
        model(torch.randn(1, 2))
        g = cap.show()
    assert g.complete and [n.id for n in g.modules()] == ["root#0", "0#0", "1#0"]
