"""Custom assertions, one of each kind, each written to fail on this program."""
import torch
import torch.nn as nn

import mldebug
from mldebug.assertions import (BACKWARD, FORWARD, FunctionAssertion, FunctionNodeAssertion,
                                ModuleAssertion, ParamAssertion, TensorAssertion,
                                TensorNodeAssertion)


class LossBelow(TensorAssertion):
    name = "custom_loss_below_1"
    message = "loss is not below 1"
    hint = "it is a test"

    def check(self, tensor, grad=None):
        return float(tensor.detach()) < 1.0


class HeadBiasGrad(ParamAssertion):
    name = "custom_param_small_grad"
    message = "a bias gradient is not tiny"
    params = ("*.bias",)

    def check(self, name, param, grad):
        return grad is None or float(grad.abs().max()) < 1e-9


class FollowNode(TensorNodeAssertion):
    name = "custom_tensor_node"
    message = "node 1#0's output has negative values"
    nodes = ("1#0",)
    check_on = (FORWARD, BACKWARD)
    seen = []

    def check(self, node_id, tensor, grad):
        self.seen.append((self.stage, node_id, grad is not None))
        return self.stage != FORWARD or float(tensor.detach().min()) >= 0


class SoftmaxRows(FunctionAssertion):
    name = "custom_function"
    message = "softmax rows do not sum to 2"
    check_on = (FORWARD, BACKWARD)
    seen = []

    def check(self, output, inputs, grads):
        self.seen.append((self.stage, sorted(grads)))
        return bool(torch.allclose(output.sum(-1), torch.full_like(output.sum(-1), 2.0)))


class LinearOut(ModuleAssertion):
    name = "custom_module"
    message = "a Linear's output is wider than 4"

    def check(self, module, output, inputs, grads):
        return module.out_features <= 4


class NodeIds(FunctionNodeAssertion):
    name = "custom_function_node"
    message = "the Tanh ran"
    seen = []

    def check(self, node_id, output, inputs, grads):
        self.seen.append(node_id)
        return False


class PositiveScores(FunctionAssertion):
    name = "custom_python_function"
    message = "scores() returned negative values"

    def check(self, output, inputs, grads):
        return float(output.detach().min()) >= 0


def scores(logits):
    return logits * 2


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
mldebug.register_assertion(PositiveScores(targets=[scores]))
for a in (LossBelow(), HeadBiasGrad(), FollowNode(), SoftmaxRows(targets=[torch.softmax]),
          LinearOut(targets=nn.Linear), NodeIds(targets=[model[1]])):
    mldebug.register_assertion(a)

opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 4)
opt.zero_grad()
probs = torch.softmax(scores(model(x)), -1)  # python function
loss = probs.pow(2).sum() * 10
loss.backward()
opt.step()
