"""The read paths are one table (probe.hooks.readers.READERS) and the mixers' terms kinds carry their
own functions (probe.hooks.terms_kinds): no module branches on a read path's or a mixer kind's name."""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path

import probe
from probe.hooks import implicit, kernel_mixers, linear_mixers
from probe.hooks.readers import BLOCK_SPARSE, FUNCTION, IMPLICIT, LONGFORMER_BAND, READERS, ReadPath
from probe.hooks.sites import Site
from probe.hooks.terms_kinds import TermsKind

ROOT = Path(probe.__file__).parent
#: where the names may be compared: the read-path table, the terms kinds, and the contract's own
#: ``maps`` field (StackContract's properties: probe.models.core imports nothing below it)
NAMES_LIVE_IN = {"hooks/readers.py", "hooks/terms_kinds.py", "models/core.py"}
MIXER_KINDS = {str(value) for module in (implicit, linear_mixers, kernel_mixers)
               for value in vars(module).values() if isinstance(value, TermsKind)}
NAMES = {reader.name for reader in READERS} | MIXER_KINDS
#: what holds a read path's or a mixer kind's name: ``x.kind``, ``x.maps``, ``x.layer_maps``
FIELDS = {"kind", "maps", "layer_maps"}


def _names_in(node) -> bool:
    """``node`` is one of the names, or a tuple, list or set literal holding one."""
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_in(e) for e in node.elts)


def _holds_a_name(node) -> bool:
    """``node`` reads a field that holds such a name: ``.kind``, ``.maps``, ``.layer_kind(...)``,
    ``getattr(x, "maps", ...)``, ``d.get("maps", ...)``, a variable called kind(s) or maps, or a
    set, list or generator of those."""
    if isinstance(node, (ast.SetComp, ast.ListComp, ast.GeneratorExp)):
        return _holds_a_name(node.elt)
    if isinstance(node, ast.Attribute):
        return node.attr in FIELDS
    if isinstance(node, ast.Name):
        return "kind" in node.id or "maps" in node.id
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "layer_kind":
            return True
        fields = [a.value for a in node.args if isinstance(a, ast.Constant)]
        asks = (isinstance(func, ast.Name) and func.id == "getattr") or (isinstance(func, ast.Attribute)
                                                                         and func.attr == "get")
        return asks and any(f in FIELDS for f in fields)
    return False


def _name_comparisons(source: str, where: str) -> list[str]:
    """``where:line`` of every comparison (==, !=, in, not in) of a field holding a read path's or a
    mixer kind's name against one of those names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(_names_in(o) for o in operands) and any(_holds_a_name(o) for o in operands):
            found.append(f"{where}:{node.lineno}")
    return sorted(found, key=lambda hit: int(hit.rsplit(":", 1)[1]))


def test_no_module_branches_on_a_read_path_or_mixer_kind_name():
    found = [hit for path in sorted(ROOT.rglob("*.py")) if str(path.relative_to(ROOT)) not in NAMES_LIVE_IN
             for hit in _name_comparisons(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("ask the site's read path (site.reader, probe.hooks.readers) or the stack contract "
                       f"(info.implicit, info.layer_implicit) instead of comparing a name: {found}")


def test_the_name_finder_finds_branches():
    source = ('def f(site, info, terms, kinds, maps, mixer, stacks):\n'
              '    if site.kind == "banded" or info.layer_kind(0) != "softmax":\n'
              '        return terms.kind in ("rwkv", "conv")\n'
              '    if "implicit" in kinds or maps in (None, "softmax") or getattr(info, "maps", "") == "implicit":\n'
              '        return {st.get("maps") for st in stacks} == {"implicit"}\n'
              '    return mixer == "conv" or info.mask_kind == "causal" or site.kind == "prob"\n')
    assert _name_comparisons(source, "f") == ["f:2", "f:2", "f:3", "f:4", "f:4", "f:4", "f:5"]


def test_the_names_are_those_written_to_contracts():
    assert [r.name for r in READERS] == ["banded", "banded", "banded", "implicit", "function", "probabilities",
                                         "softmax"]  # Longformer's band, BigBird's blocks, LongT5's blocks
    assert {"mamba", "mamba2", "rwkv", "conv", "rglru", "gated_deltanet", "kimi_delta", "lightning", "mlstm",
            "yoso"} == MIXER_KINDS


def test_every_read_path_is_one_row_with_a_name_and_words():
    assert len({type(r) for r in READERS}) == len(READERS)
    for reader in READERS:
        assert isinstance(reader, ReadPath) and reader.name and reader.describe
    assert [r.name for r in READERS if not r.can_edit] == ["banded", "banded", "banded", "implicit"]
    assert IMPLICIT.implicit and not FUNCTION.implicit
    assert [r for r in READERS if type(r).guard is not ReadPath.guard] == [BLOCK_SPARSE]  # BigBird's guard


def test_a_site_holds_its_reader_and_says_its_kind():
    site = Site("encoder", 0, "layer.0.attention", LONGFORMER_BAND)
    assert site.reader is LONGFORMER_BAND and site.kind == "banded"
    # pickled or copied, a site keeps the table's own row (the capture looks its reader up by identity)
    assert pickle.loads(pickle.dumps(site)).reader is LONGFORMER_BAND
    assert copy.deepcopy(site).reader is LONGFORMER_BAND and copy.deepcopy(FUNCTION) is FUNCTION


def test_a_terms_kind_is_its_name():
    kind = TermsKind("planted", lambda terms, units: None, lambda module, terms, scan: None, own_heads=True)
    assert kind == "planted" and repr(kind) == "'planted'" and kind.own_heads and not kind.per_state
    assert linear_mixers.MLSTM == "mlstm" and implicit.MAMBA2.own_heads and implicit.MAMBA.per_state
