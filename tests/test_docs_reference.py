"""The generated reference pages (docs/_ext/probe_docs.py) miss nothing the code has.

Each test lists what the code holds on its own (the registry, the typer app, the pydantic schemas,
the ProbeError subclasses found by walking the package) and checks that the generated Markdown names
it, so a new method, command, option, key or error that the pages would miss fails here. No model
is loaded and Sphinx is not run.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
import sys
import typing
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import probe_docs  # noqa: E402


def _sections(markdown: str, level: str) -> dict[str, str]:
    """``{heading text: the section's text}`` for the headings of one level (``"##"``, ``"###"``)."""
    out: dict[str, str] = {}
    parts = re.split(rf"^{level} (.+)$", markdown, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        out[heading.strip()] = body
    return out


def _table_keys(section: str) -> list[str]:
    """The first column of a section's table rows, without the backticks."""
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


# ---------------------------------------------------------------------------------------- methods


@pytest.fixture(scope="module")
def methods_md() -> str:
    return probe_docs.methods_markdown()


def test_methods_page_holds_the_readme_table(methods_md):
    from probe import registry

    assert "\n".join(registry.method_table()) in methods_md


def test_methods_page_names_every_method_and_counterfactual_with_its_parameters(methods_md):
    from probe import registry

    sections = _sections(methods_md, "###")
    entries = [*registry.REGISTRY, *registry.COUNTERFACTUALS]
    assert {e.name for e in registry.methods()} <= {e.name for e in registry.REGISTRY}
    for entry in entries:
        section = sections.get(f"`{entry.name}`")
        assert section is not None, f"the methods page has no section for {entry.name}"
        defaults = entry.defaults()
        for field in dataclasses.fields(entry.params):
            row = re.search(rf"^\| `{field.name}` \|.*$", section, flags=re.M)
            assert row is not None, f"{entry.name}: parameter {field.name} missing"
            assert f"`{probe_docs._yaml(getattr(defaults, field.name))}`" in row.group(0), \
                f"{entry.name}.{field.name}: default missing"
        assert ("takes a seed: yes" if entry.takes_seed else "takes a seed: no") in section


# -------------------------------------------------------------------------------------------- CLI


def test_cli_page_names_every_command_argument_and_option():
    import typer

    from probe.cli import app

    markdown = probe_docs.cli_markdown()
    sections = _sections(markdown, "##")
    commands = typer.main.get_command(app).commands
    assert commands, "the typer app has no commands"
    for name, command in commands.items():
        section = sections.get(f"`probe {name}`")
        assert section is not None, f"the CLI page has no section for probe {name}"
        assert f"Usage: probe {name}" in section
        for param in command.params:
            if param.name == "help" or getattr(param, "hidden", False):
                continue
            if param.param_type_name == "option":
                for opt in [*param.opts, *param.secondary_opts]:
                    assert f"`{opt}`" in section, f"probe {name}: option {opt} missing"
            else:
                assert any(param.name in key.lower() for key in _table_keys(section)), \
                    f"probe {name}: argument {param.name} missing"
            if getattr(param, "help", None):
                assert probe_docs._escape(" ".join(param.help.split())[:40]) in section, \
                    f"probe {name}: help of {param.name} missing"


# ------------------------------------------------------------------------------------------ specs


def _models_in(annotation) -> list[type]:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _every_model(root) -> list[type]:
    """``root`` and every pydantic model reachable from its fields."""
    found = [root]
    for model in found:
        for field in model.model_fields.values():
            found += [m for m in _models_in(field.annotation) if m not in found]
    return found


def _keys_on_page(markdown: str) -> set[str]:
    return {key for section in _sections(markdown, "##").values() for key in _table_keys(section)} | \
        {key for section in _sections(markdown, "###").values() for key in _table_keys(section)}


def test_study_page_names_every_key():
    from probe.spec.study import Study

    markdown = probe_docs.study_markdown()
    top = _sections(markdown, "##")["Top level"]
    assert _table_keys(top) == [f.alias or name for name, f in Study.model_fields.items()]
    keys = _keys_on_page(markdown)
    for model in _every_model(Study):
        for name, field in model.model_fields.items():
            assert (field.alias or name) in keys, f"{model.__name__}.{name} missing from the study page"


def test_claims_page_names_every_key_and_claim_kind():
    from probe.claims import file as claims
    from probe.claims.kinds import KINDS

    markdown = probe_docs.claims_markdown()
    top = _sections(markdown, "##")["Top level"]
    assert _table_keys(top) == [f.alias or name for name, f in claims._FileSchema.model_fields.items()]
    kinds = _sections(markdown, "###")
    for kind, cls in ((name, entry.spec) for name, entry in KINDS.items()):
        section = kinds.get(f"kind: `{kind}`")
        assert section is not None, f"claim kind {kind} missing"
        assert _table_keys(section) == [f.alias or name for name, f in cls.model_fields.items()]
    keys = _keys_on_page(markdown)
    for model in _every_model(claims._FileSchema):
        for name, field in model.model_fields.items():
            assert (field.alias or name) in keys, f"{model.__name__}.{name} missing from the claims page"


def _yaml_example(page: str) -> dict:
    text = (DOCS / "reference" / page).read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", text, flags=re.S)
    assert block is not None, f"{page} has no YAML example"
    return yaml.safe_load(block.group(1))


def test_the_yaml_examples_on_the_pages_are_valid():
    from probe.claims.file import claims_from_dict
    from probe.spec.study import study_from_dict

    study_from_dict(_yaml_example("study-files.md"), source="study-files.md")
    claims_from_dict(_yaml_example("claim-files.md"), source="claim-files.md")


# ----------------------------------------------------------------------------------------- errors


def test_errors_page_names_every_probe_error():
    import probe
    from probe.errors import ProbeError

    found = set()
    for info in pkgutil.walk_packages(probe.__path__, "probe."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        found |= {cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, ProbeError) and cls.__module__ == module.__name__}
    assert ProbeError in found
    markdown = probe_docs.errors_markdown()
    sections = _sections(markdown, "##")
    for cls in found:
        section = sections.get(f"`{cls.__name__}`")
        assert section is not None, f"{cls.__module__}.{cls.__name__} missing from the errors page"
        assert f"`{cls.__module__}.{cls.__qualname__}`" in section
        doc = inspect.getdoc(cls)
        assert doc and " ".join(doc.split()[:6]) in " ".join(section.split()), f"{cls.__name__}: docstring missing"


# ------------------------------------------------------------------------------------ the pages


def test_every_generated_page_is_written_and_included(tmp_path):
    written = probe_docs.write_generated(tmp_path)
    assert sorted(p.name for p in written) == sorted(probe_docs.GENERATED)
    assert probe_docs.write_generated(tmp_path) == []  # unchanged text: nothing rewritten
    pages = {"methods.md": "methods.md", "cli.md": "cli.md", "study-fields.md": "study-files.md",
             "claim-fields.md": "claim-files.md", "errors.md": "errors.md"}
    for generated, page in pages.items():
        assert f"```{{include}} _generated/{generated}\n```" in (DOCS / "reference" / page).read_text(encoding="utf-8")
    assert '"reference/_generated"' in (DOCS / "conf.py").read_text(encoding="utf-8")
