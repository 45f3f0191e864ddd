"""The Task object (probe.tasks): one class per task, read by every layer instead of task names."""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path

import pytest

from probe.errors import InputError
from probe.tasks import TASKS, Task, task_named

ROOT = Path(__file__).resolve().parents[1] / "probe"
#: where a task's name may still be compared: the Task classes and the inference that picks one
NAMES_LIVE_IN = {"tasks.py", "models/tasks.py"}


def test_every_task_is_one_registered_class_with_every_field():
    assert list(TASKS) == ["classification", "causal_lm", "seq2seq", "encoder"]
    for name, task in TASKS.items():
        assert isinstance(task, Task) and type(task) is not Task and task.name == name
        assert task.head and task.target_query_note and task.attributed
        assert task.default_kind is None or task.default_kind in task.kinds
        assert task_named(name) is task and task_named(task) is task
    # the fields that split the tasks: each task is told apart from every other one by them
    keys = {name: (t.labels, t.next_token, t.encoder_decoder, t.embeds) for name, t in TASKS.items()}
    assert len(set(keys.values())) == len(TASKS)


def test_a_task_is_not_its_name():
    task = TASKS["causal_lm"]
    with pytest.raises(TypeError, match=r"task.name == 'causal_lm'"):
        _ = task == "causal_lm"
    with pytest.raises(TypeError):
        _ = task in ("classification", "causal_lm")
    assert str(task) == "causal_lm" and f"{task} model" == "causal_lm model"
    assert pickle.loads(pickle.dumps(task)) is task and copy.deepcopy(task) is task


def test_an_unknown_task_is_refused_in_one_line():
    with pytest.raises(InputError, match=r"unknown task 'regression': use one of classification, causal_lm"):
        task_named("regression")


def test_row_length_is_what_build_rows_pads_to(loaded):
    from probe.rows.forward import build_rows
    from probe.rows.prepare import prepare
    from probe.rows.target import TargetSpec

    for kind, continuation in (("bert", None), ("gpt2", " a good film"), ("t5", "a good film")):
        pm = loaded(kind)
        [example] = prepare(pm, ["the film was good"], TargetSpec(continuation=continuation))
        batch = build_rows(pm, [(example.input_ids, example)])
        fed = batch.inputs["input_ids"].numel() + (batch.inputs["decoder_input_ids"].numel()
                                                   if "decoder_input_ids" in batch.inputs else 0)
        assert pm.task.row_length(len(example.input_ids), len(example.target_ids)) == fed, kind


def test_the_stacks_a_task_reads(loaded):
    for kind, target, inputs in (("bert", "encoder", "encoder"), ("gpt2", "decoder", "decoder"),
                                 ("bart", "cross", "encoder")):
        pm = loaded(kind)
        assert (pm.task.target_stack(pm.contract), pm.task.input_stack(pm.contract)) == (target, inputs), kind


def test_a_model_holds_its_task_and_stores_its_name(loaded):
    pm = loaded("gpt2")
    assert pm.task is TASKS["causal_lm"] and pm.contract.task is pm.task
    assert pm.contract.to_dict()["task"] == "causal_lm"


def _task_name_comparisons(source: str, label: str) -> list[str]:
    """Comparisons of a ``task`` with a task's name, and lookups keyed by one (``{...}[pm.task]``)."""
    names = set(TASKS)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)}
            reads_task = any(isinstance(n, (ast.Attribute, ast.Name)) and getattr(n, "attr", getattr(n, "id", None))
                             == "task" for s in sides for n in ast.walk(s))
            if consts & names and reads_task:
                found.append(f"{label}:{node.lineno}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Attribute) and node.slice.attr == "task":
            found.append(f"{label}:{node.lineno}")
    return found


def test_no_layer_branches_on_a_task_name():
    found = [hit for path in sorted(ROOT.rglob("*.py")) if str(path.relative_to(ROOT)) not in NAMES_LIVE_IN
             for hit in _task_name_comparisons(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, f"read a field of probe.tasks.Task instead of comparing its name: {found}"


def test_the_branch_finder_finds_branches():
    source = ('def f(pm, task, stack):\n    if pm.task == "seq2seq" or task in ("encoder",):\n'
              '        return {"a": 1}[pm.task]\n    return stack == "encoder"\n')
    assert _task_name_comparisons(source, "f") == ["f:2", "f:2", "f:3"]  # stack == "encoder" is no task
