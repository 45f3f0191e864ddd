"""An explanation: token scores of several methods on the same prepared examples, its tables and its
folder on disk (:meth:`Explanation.save`, :func:`load_explanation`; the files: :mod:`.folder`).
How it shows itself (a notebook table, plots, a generated text's prompt x output matrix) is
:mod:`.views`'s, which its ``_repr_html_``, :meth:`~Explanation.plot` and
:meth:`~Explanation.plot_matrix` call.

:func:`probe.explain <probe.api.explain>` makes one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from probe.errors import InputError, positive_int
from probe.explanation.folder import (
    EXPLANATION_FORMAT,
    check_explanation_folder,
    example_record,
    json_value,
    read_explanation_folder,
    saved_examples,
    saved_scores,
)
from probe.explanation.views import (
    explanation_html,
    faded_columns,
    flag_lines,
    generated_groups,
    matrix_heatmap,
    method_rows,
    read_at,
    scores_figure,
)
from probe.explanation.words import WordTable, word_level_table
from probe.frozen import PicklableFrozen
from probe.rows.inputs import arguments_checked
from probe.rows.scores import TokenScores
from probe.rows.target import PreparedExample

if TYPE_CHECKING:
    from probe.plots import Figure


class ScoresWarning(UserWarning):
    """Scores asked for come from a method whose own check failed on them (not converged, constant,
    a degenerate site): :meth:`Explanation.top_tokens <probe.Explanation.top_tokens>` warns with why."""


class TopTokens(list):
    """:meth:`Explanation.top_tokens <probe.Explanation.top_tokens>`' ``[(position, token, score), ...]``;
    ``flags``: a line per failed check of the method on this example (empty when none), which the repr
    shows below the list; ``read_at``: which layer and head a per-layer or per-head method was read at
    (``"layer 5 of 0..5, the last, head mean"``; "" for a token-level method), which the repr shows where
    heads were averaged."""

    flags: tuple[str, ...] = ()
    read_at: str = ""

    def __repr__(self) -> str:
        shown = [f"read at {self.read_at}"] if self.read_at.endswith("head mean") else []
        return super().__repr__() + "".join(f"\n# {line}" for line in (*shown, *self.flags))


@dataclass(frozen=True, repr=False)
class Explanation(PicklableFrozen):
    """Token scores of several methods on the same prepared examples.

    ``scores[method]`` is that method's :class:`TokenScores` (per example ``[tokens]``,
    ``[layer, head, tokens]`` or ``[layer, tokens]``); ``skipped`` says why default methods were
    left out (only when the methods were not chosen). ``words``: per example, each word's text and
    the positions of its tokens, as the tokenizer's offsets and word ids (:func:`explain` fills it)
    split them; None when made without a tokenizer (then the token markers decide, see
    :meth:`to_pandas`).

    In a notebook it shows itself as a token x method table (``_repr_html_``); :meth:`plot` draws
    one example's scores.

    A score is NaN where the method does not score the token: special tokens ([CLS], [SEP], <s>,
    ...; ``examples[i].special``) under the interventions, which never delete them. Attention and
    gradient methods do score special tokens. So ``scores.argmax()`` and ``topk`` can return a
    special token (torch sorts NaN above every number): :meth:`top_tokens` ranks real tokens only.
    An explanation pickles, and :meth:`save` / :func:`load_explanation` keep it in a folder.
    """

    model: str
    examples: tuple[PreparedExample, ...]
    scores: Mapping[str, TokenScores]
    skipped: Mapping[str, str] = field(default_factory=dict)
    words: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...] | None = field(default=None, compare=False)
    #: per example, the spans ``explain(..., spans=...)`` found (:class:`probe.rows.spans.Span`)
    spans: tuple[tuple[Any, ...], ...] | None = field(default=None, compare=False)
    #: the methods' own checks that failed on these scores (:class:`probe.study.sanity.ScoreFlag`:
    #: IG completeness above its tolerance, constant scores, a degenerate site), per example where
    #: the check is; every display marks them. None: not recorded, found from the scores when asked
    #: (:meth:`failed_checks`; a degenerate site needs the model, so only :func:`explain` finds it)
    flags: tuple[Any, ...] | None = field(default=None, compare=False)

    @property
    def methods(self) -> list[str]:
        return list(self.scores)

    def failed_checks(self, method: str | None = None, example: int | None = None) -> list:
        """The failed checks (:class:`~probe.study.sanity.ScoreFlag`) of ``method`` (default: every
        method) that mark example ``example`` (default: any): e.g. integrated gradients whose
        completeness delta on that example is above its tolerance (not converged)."""
        flags = self.flags
        if flags is None:
            from probe.study.sanity import score_flags

            flags = tuple(score_flags(self.examples, self.scores))
            object.__setattr__(self, "flags", flags)  # found once; the scores are frozen
        return [f for f in flags if (method is None or f.method == method)
                and (example is None or f.covers(example % max(len(self.examples), 1)))]

    def top_tokens(self, k: int = 5, method: str | None = None, example: int = 0, *, layer: int = -1,
                   head: int | None = None, level: str = "token", agg: str = "sum") -> TopTokens:
        """``(position, token, score)`` of the ``k`` highest scored tokens of ``examples[example]`` by ``method``
        (default: the only method), highest first, shown as the tables show them (``Ġis`` -> ``is``; the
        tokenizer's string is ``examples[example].tokens[position]``); special tokens and NaN scores left out,
        ties in token order. A per-layer method is read at ``layer`` (default the last), a per-head one at
        ``layer`` and ``head`` (None: the NaN-aware head mean the HTML table shows; ``read_at`` says which).
        ``level="word"``: ``(word index, word, score)``, each word the ``agg`` of its tokens. Where the method's
        check failed on this example, ``flags`` say why and a :class:`~probe.explanation.ScoresWarning` is issued."""
        positive_int(k, "k")
        if method is None:
            if len(self.scores) != 1:
                raise InputError(f"this explanation has {len(self.scores)} methods ({', '.join(self.scores)}): "
                                 "give method=NAME")
            method = next(iter(self.scores))
        result = self[method]
        n = len(self.examples)
        if isinstance(example, bool) or not isinstance(example, int) or not -n <= example < n:
            raise InputError(f"example={example!r} does not exist: this explanation has examples "
                             f"0..{len(self.examples) - 1}")
        chosen = self.examples[example]
        scores = result.row(example, layer, head).double().numpy()
        from probe.display import shown_token

        names, special = [shown_token(t) for t in chosen.tokens], [bool(s) for s in chosen.special]
        if level != "token":  # words: the position is the word's index, its score the agg of its tokens
            from probe.explainers.words import word_rows

            names, special, rows = word_rows(level, self.word_groups(example % n), special, {"": scores}, agg)
            scores = rows[""]
        real = [p for p in range(len(scores)) if not special[p] and not np.isnan(scores[p])]
        ranked = sorted(real, key=lambda p: -scores[p])[:k]  # sorted is stable: ties keep the token order
        top = TopTokens((p, names[p], float(scores[p])) for p in ranked)
        top.read_at = read_at(self, method, layer, head)
        top.flags = tuple(flag_lines(self, example % len(self.examples), method))
        if top.flags:
            from probe.errors import warn_at_caller

            warn_at_caller(f"top_tokens(method={method!r}, example={example}): " + "; ".join(top.flags), ScoresWarning)
        return top

    def outputs(self) -> list[tuple[int, ...]]:
        """A step-by-step explanation (``generate=`` / ``steps=True``): per explained text, the
        indices into :attr:`examples` of its output tokens, in order (empty when the targets are
        not steps)."""
        from probe.rows.target import sources

        groups: dict[int, list[int]] = {}
        for i, (e, text) in enumerate(zip(self.examples, sources(self.examples))):
            if e.output_index is not None:
                groups.setdefault(text, []).append(i)
        return [tuple(g) for g in groups.values()]

    def _output_group(self, text: int) -> tuple[int, ...]:
        groups = self.outputs()
        if not groups:
            raise InputError("this explanation explains one target per text, not its output token by token: explain "
                             "with generate=N (or steps=True and a continuation) for output x source matrices")
        if isinstance(text, bool) or not isinstance(text, int) or not -len(groups) <= text < len(groups):
            raise InputError(f"text={text!r} does not exist: this explanation has texts 0..{len(groups) - 1}")
        return groups[text]

    def stacked(self, method: str, text: int = 0) -> torch.Tensor:
        """``method``'s scores of text ``text``'s output tokens stacked: ``[output token, ...,
        source token]`` (``...``: the method's layer and head axes, if any); a row per output token,
        whose target is that token's log-prob given the prompt and the output before it."""
        result = self[method]
        rows = [result.scores[i] for i in self._output_group(text)]
        width = max(r.shape[-1] for r in rows)  # target-side rows grow by the output written before them
        return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[-1]), value=float("nan")) for r in rows])

    def matrix(self, method: str, text: int = 0, *, layer: int = -1, head: int | None = None) -> pd.DataFrame:
        """The ``[output token x source token]`` matrix of ``method`` for text ``text``: one row per
        output token (index: ``"step: token"``), one column per source token (``"position: token"``),
        each token as ``probe.display.shown_token`` shows it (whitespace visible: ``2: ↵``).
        A per-layer method is read at ``layer`` (default the last), a per-head one at ``layer`` and
        ``head`` (None: the mean over heads). NaN where the method does not score a token."""
        from probe.display import shown_token

        values = self.stacked(method, text)
        result = self[method]
        if result.per_head or result.per_layer:
            n_layers = values.shape[1]
            if isinstance(layer, bool) or not isinstance(layer, int) or not -n_layers <= layer < n_layers:
                raise InputError(f"layer={layer!r} does not exist: {method} has layers 0..{n_layers - 1} (-1 is the "
                                 f"last)")
            values = values[:, layer]
        if result.per_head:
            n_heads = values.shape[1]
            if head is None:
                values = values.mean(dim=1)
            elif isinstance(head, bool) or not isinstance(head, int) or not -n_heads <= head < n_heads:
                raise InputError(f"head={head!r} does not exist: {method} has heads 0..{n_heads - 1}")
            else:
                values = values[:, head]
        group = self._output_group(text)
        widest = self.examples[max(group, key=lambda i: len(self.examples[i].tokens))]
        rows = [f"{self.examples[i].output_index}: {shown_token(self.examples[i].label_name)}" for i in group]
        columns = [f"{p}: {shown_token(t)}" for p, t in enumerate(widest.tokens)]
        return pd.DataFrame(values.double().numpy(), index=pd.Index(rows, name="output token"),
                            columns=pd.Index(columns, name="source token"))

    def plot_matrix(self, method: str, text: int = 0, *, layer: int = -1, head: int | None = None) -> Figure:
        """:meth:`matrix` as a heatmap: output tokens down, source tokens across; a per-layer or
        per-head method at ``layer`` (default the last) and ``head`` (default their mean), which the
        title names; the prompt (a chat prompt's messages) above the map, wrapped, not cut. Returns
        a :class:`matplotlib.figure.Figure`."""
        return matrix_heatmap(self, method, text, layer=layer, head=head)

    def save(self, path: str | Path) -> Path:
        """Write the explanation into the folder ``path`` (made if missing): ``scores.parquet``
        (:meth:`to_pandas`) and ``explanation.json`` (model, examples, methods with their
        parameters, flags, extras and score shapes, skipped); :func:`load_explanation` reads it
        back equal, every score exactly. Returns the folder."""
        import json

        from probe.files import write_file
        from probe.study.store import write_table

        folder = Path(path)
        check_explanation_folder(folder)
        record = {
            "format": EXPLANATION_FORMAT, "model": self.model,
            "examples": [example_record(e) for e in self.examples],
            "methods": [{"name": m, "per_head": s.per_head, "per_layer": s.per_layer, "params": json_value(s.params),
                         "extras": json_value(s.extras), "shapes": [list(v.shape) for v in s.scores]}
                        for m, s in self.scores.items()],
            "skipped": dict(self.skipped),
            # the methods' failed checks, as found when explained (a degenerate site needs the model): a loaded
            # explanation marks the same scores
            "flags": [f.to_dict() for f in self.failed_checks()],
        }
        # each file whole or not at all, a failed write's temporary file removed (the store's own writers)
        write_table(folder / "scores.parquet", self.to_pandas())
        write_file(folder / "explanation.json", json.dumps(record, indent=1))
        return folder

    def __getitem__(self, method: str) -> TokenScores:
        if method not in self.scores:
            raise InputError(f"method {method!r} was not run: this explanation has {', '.join(self.scores)}")
        return self.scores[method]

    def __repr__(self) -> str:
        from probe.display import name_list

        n = len(self.examples)
        groups = generated_groups(self)
        counted = (f"{len(groups)} prompt{'s' if len(groups) != 1 else ''}, {n} output token{'s' if n != 1 else ''}"
                   if groups else f"{n} text{'s' if n != 1 else ''}")
        text = f"<Explanation {self.model}: {counted} x {len(self.scores)} method"
        text += f"{'s' if len(self.scores) != 1 else ''} ({name_list(s.label for s in self.scores.values())})"
        return text + (f", {len(self.skipped)} skipped>" if self.skipped else ">")

    def to_pandas(self, level: str = "token", *, agg: str = "sum") -> pd.DataFrame:
        """The scores as a tidy table.

        ``level="token"`` (default): one row per (example, method, layer, head, token): columns
        ``example`` (index into ``examples``), ``position``, ``token`` (the tokenizer's string),
        ``clean_token`` (the same without the ``##`` / ``Ġ`` / ``▁`` markers), ``special``,
        ``method``, ``layer``, ``head`` (-1 where the method has none), ``score`` (float64; NaN
        where a method does not score the token, e.g. special tokens under leave-one-out). The
        ``scores`` table a study stores, with the token text beside each position.

        ``level="span"`` (an explanation made with ``spans=``): one row per (example, span, method,
        layer, head): columns ``example``, ``span_index``, ``span`` (its text), ``start``, ``end``
        (character offsets), ``n_tokens``, ``method``, ``layer``, ``head``, ``score``, the span's
        token scores folded by ``agg`` as words are.

        ``level="word"``: one row per (example, method, layer, head, word), the sub-word scores of
        each word folded by ``agg`` (``sum``, ``max`` or ``mean``): columns ``example``, ``word_index``,
        ``word`` (its text), ``first_position`` and ``n_tokens`` (its tokens), ``special``,
        ``method``, ``layer``, ``head``, ``score``. Words are split as :func:`explain` recorded them
        from the tokenizer's offsets and word ids (``words``); an explanation without them splits at
        the token markers (a ``##`` piece continues a word; a ``Ġ`` / ``▁`` piece starts one). A
        special token is always a word of its own (``special`` True, its score as the token's).
        NaN-aware: NaN tokens are left out of a word's sum, max or mean, and a word whose tokens
        are all NaN is NaN (not 0, which would read as unimportant). ``max`` is the largest
        signed value.

        ``attrs["labels"]``: per method, its name with the settings that make its numbers differ
        from captum's or inseq's (``TokenScores.label``:
        ``{"saliency": "saliency (L2)", ...}``); the ``method`` column holds the names.
        """
        if level == "word":
            frame = self._word_frame(agg)
        elif level == "span":
            from probe.rows.spans import span_table

            if self.spans is None:
                raise InputError("this explanation has no spans: explain with spans=PATTERN (a regular expression) or "
                                 "spans=[(start, end), ...] (character offsets)")
            frame = span_table(self.scores, self.spans, agg)
        elif level == "token":
            frame = self._token_frame()
        else:
            raise InputError(f"level={level!r} is not a level of the table: use 'token', 'word' or 'span'")
        frame.attrs["labels"] = {method: result.label for method, result in self.scores.items()}
        return self._with_outputs(frame)

    def _with_outputs(self, frame: pd.DataFrame) -> pd.DataFrame:
        """A step explanation's table (every example an output token) with, after ``example``, the
        text it belongs to (``text``, as :meth:`matrix` counts them), its ``output_index`` and its
        ``output_token`` (as the views show it: ``␣`` for a space); other tables as they are."""
        from probe.display import shown_token

        if not self.examples or any(getattr(e, "output_index", None) is None for e in self.examples):
            return frame  # not every example an output token (:meth:`_generated_groups`)
        groups = self.outputs()
        text = np.zeros(len(self.examples), dtype=np.int64)
        for t, group in enumerate(groups):
            text[list(group)] = t
        at = frame["example"].to_numpy(dtype=np.int64)
        where = frame.columns.get_loc("example") + 1
        # every example is an output token here, whose label_name is its text (never None)
        tokens = np.array([shown_token(str(e.label_name)) for e in self.examples], dtype=object)
        frame.insert(where, "output_token", tokens[at])
        frame.insert(where, "output_index", np.array([e.output_index for e in self.examples], dtype=np.int64)[at])
        frame.insert(where, "text", text[at])
        return frame

    def _token_frame(self) -> pd.DataFrame:
        from probe.display import clean_token

        columns = ["example", "position", "token", "clean_token", "special", "method", "layer", "head", "score"]
        tokens = np.array([t for e in self.examples for t in e.tokens], dtype=object)
        clean = np.array([clean_token(t) for t in tokens], dtype=object)
        special = np.array([bool(s) for e in self.examples for s in e.special], dtype=bool)
        starts = np.cumsum([0] + [len(e.tokens) for e in self.examples])[:-1]
        frames = []
        for method, result in self._checked_scores():
            frame = result.to_pandas()
            at = starts[frame["example"].to_numpy()] + frame["position"].to_numpy()
            frame["token"], frame["clean_token"], frame["special"] = tokens[at], clean[at], special[at]
            frame["method"] = method
            frames.append(frame[columns])
        if not frames:
            return pd.DataFrame(columns=columns)
        return pd.concat(frames, ignore_index=True)

    def _checked_scores(self):
        """(method, TokenScores) of the methods that scored something, each tensor's length checked."""
        for method, result in self.scores.items():
            if not len(result.scores):
                continue
            for i, values in enumerate(result.scores):
                if values.shape[-1] != len(self.examples[i].tokens):
                    raise ValueError(f"{method} scores {values.shape[-1]} tokens of example #{i}, which has "
                                     f"{len(self.examples[i].tokens)}")
            yield method, result

    def word_groups(self, index: int) -> list[tuple[str, tuple[int, ...]]]:
        """Example ``index``'s words: each one's text and the positions of its tokens (see :meth:`to_pandas`)."""
        if self.words is not None:
            return [(text, tuple(group)) for text, group in self.words[index]]
        from probe.display import clean_token
        from probe.explainers.words import groups_from_prefixes

        example = self.examples[index]
        groups = groups_from_prefixes(list(example.tokens), [bool(s) for s in example.special])
        return [(example.tokens[g[0]] if example.special[g[0]] else "".join(clean_token(example.tokens[i]) for i in g),
                 tuple(g)) for g in groups]

    def _word_frame(self, agg: str) -> pd.DataFrame:
        from probe.explainers.words import word_table

        return word_table(list(self._checked_scores()), [self.word_groups(i) for i in range(len(self.examples))],
                          [e.special for e in self.examples], agg)

    def _repr_html_(self) -> str:
        return explanation_html(self)

    def word_table(self, agg: str = "sum") -> WordTable:
        """The notebook table at word level, each word the ``agg`` of its tokens' scores (sum, mean, max)."""
        return word_level_table(self, agg)

    def columns(self, index: int) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Example ``index``'s notebook table: method label (a failed check marked) -> ``[tokens]``
        row, and the columns left unshaded, each with why."""
        rows = method_rows(self, index, marked=True)
        return rows, faded_columns(self, index, rows)

    def plot(self, example: int = 0, methods: str | Sequence[str] | None = None, *, level: str = "token",
             agg: str = "sum") -> Figure:
        """Example ``example``'s token scores, one bar panel per method (default: all), the tokens
        on the x axis; per-layer and per-head methods show their last layer (heads averaged).
        ``level="word"``: the words on the x axis, each the ``agg`` of its tokens (as
        :meth:`to_pandas` folds them). Returns a :class:`matplotlib.figure.Figure` (on its own Agg
        canvas; nothing global changed)."""
        return scores_figure(self, example, methods, level=level, agg=agg)


@arguments_checked
def load_explanation(path: str | Path) -> Explanation:
    """The :class:`Explanation` :meth:`Explanation.save` wrote into the folder ``path``, every score exact."""
    record, table = read_explanation_folder(Path(path))
    examples = saved_examples(record)
    scores = saved_scores(record, table)
    from probe.study.sanity import ScoreFlag

    flags = None if "flags" not in record else tuple(ScoreFlag.from_dict(f) for f in record["flags"])
    return Explanation(model=record["model"], examples=examples, scores=MappingProxyType(scores),
                       skipped=MappingProxyType(dict(record.get("skipped") or {})), flags=flags)
