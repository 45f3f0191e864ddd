"""probe.rows.queries.eval_mode: the one eval-mode context every explainer and intervention runs under."""

from __future__ import annotations

import pytest
import torch

from probe.rows.queries import eval_mode


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))


@pytest.mark.parametrize("grad", [None, False, True])
def test_a_submodule_left_in_training_mode_runs_without_dropout_and_comes_back(grad):
    """The model itself in eval mode, its dropout in training mode: the interventions' context
    (``eval_no_grad``, which called ``model.eval()`` only when the model itself was training) kept
    that dropout on, so a value differed from call to call."""
    model = _model().eval()
    model[1].train()
    x = torch.ones(64, 4)
    with eval_mode(model, grad=grad):
        assert not any(m.training for m in model.modules())
        assert torch.equal(model(x), model(x))
    assert [m.training for m in model.modules()] == [False, False, True, False]  # each module as it was


def test_a_model_in_training_mode_comes_back_in_training_mode():
    model = _model().train()
    with eval_mode(model, grad=False):
        assert not model.training and not model[1].training
    assert all(m.training for m in model.modules())


def test_grad_sets_autograd_for_the_block_whatever_the_caller_has():
    with torch.no_grad():
        with eval_mode(_model(), grad=True):
            assert torch.is_grad_enabled()
        with eval_mode(_model()):
            assert not torch.is_grad_enabled()
    with eval_mode(_model(), grad=False):
        assert not torch.is_grad_enabled()
    with eval_mode(_model()):
        assert torch.is_grad_enabled()


def test_inputs_only_holds_the_parameters_flags_off_and_restores_them():
    model = _model()
    model[0].bias.requires_grad_(False)  # one the caller turned off stays off
    with eval_mode(model, grad=True, inputs_only=True):
        assert not any(p.requires_grad for p in model.parameters())
    assert [p.requires_grad for p in model.parameters()] == [True, False, True, True]
    with pytest.raises(ValueError, match="inputs_only needs grad=True"):
        with eval_mode(model, inputs_only=True):
            pass
