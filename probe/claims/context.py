"""What every claim of an audit shares: the model, the prepared examples, one engine, cached
scores and ablations, and the checks that a layer or head exists (errors point at the claim file)."""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import numpy as np

from probe import registry
from probe.claims.rules import Judgement, Rule, judge
from probe.errors import InputError
from probe.rows.target import sources
from probe.spec.claim_values import AttentionRanking, parse_layer_window
from probe.study.steps import per_example_means

if TYPE_CHECKING:
    from collections.abc import Sequence

    from probe.claims.spec import ClaimFile
    from probe.data import Example
    from probe.explainers.sinks import SinkResult
    from probe.models.core import ProbeModel
    from probe.patterns import UserPattern
    from probe.rows.scores import TokenScores
    from probe.rows.target import PreparedExample

__all__ = ["AuditContext", "WORD_PIECE_MARKERS", "token_text"]

WORD_PIECE_MARKERS = ("##", "Ġ", "▁")


def token_text(pm: ProbeModel, token_id: int) -> str:
    """A token's text for matching: decoded alone, word-piece markers and surrounding spaces stripped."""
    text = pm.tokenizer.decode([int(token_id)]).strip()
    for marker in WORD_PIECE_MARKERS:
        if text.startswith(marker):
            text = text[len(marker):]
    return text.strip()


# ------------------------------------------------------------------------------------------ context


class AuditContext:
    """What every claim shares: the model, the prepared examples, one engine, cached scores."""

    def __init__(self, pm: ProbeModel, claim_file: ClaimFile, items: list[Example], examples: list[PreparedExample],
                 progress: bool):
        from probe.intervene.engine import Engine

        self.pm, self.file, self.items, self.examples = pm, claim_file, items, examples
        self.owners = sources(examples)  # each prepared example's dataset example (step targets: many per item)
        self.engine = Engine(pm)
        self.seed = claim_file.statistics.seed
        self.progress = progress
        self.stack = pm.task.target_stack(pm.contract)
        info = pm.contract.stacks[self.stack]
        self.n_layers, self.n_heads = info.n_layers, info.n_heads
        self._scores: dict = {}
        self._ablations: dict[int, np.ndarray] = {}
        self._texts: dict[int, list[str]] = {}
        self._spans: dict[str, list] = {}  # the spans found, and span leave-one-out per reference

    @property
    def n_examples(self) -> int:
        """Dataset examples audited (with a step target: the prompts, not their output tokens)."""
        return len(self.items)

    def judge(self, values: Sequence[float] | np.ndarray, rule: Rule) -> Judgement:
        """``values`` one per prepared example; with a step target (``target.generate`` / ``steps``)
        each dataset example's output tokens are averaged first (their finite values), so the
        bootstrap is over the examples, not over their tokens."""
        s = self.file.statistics
        values = np.asarray(values, dtype=np.float64)
        if self.file.target.stepwise and len(values) == len(self.examples):
            values = per_example_means(values, self.owners)
        return judge(values, rule, n_boot=s.bootstrap, level=s.level, seed=s.seed)

    def scores(self, method: str) -> TokenScores:
        if method not in self._scores:
            from probe.methods import run_method

            params = {"seed": self.seed} if method in registry.seeded() else None
            self._scores[method] = run_method(self.pm, self.examples, method, engine=self.engine, params=params)
        return self._scores[method]

    def texts(self, i: int) -> list[str]:
        if i not in self._texts:
            self._texts[i] = [token_text(self.pm, t) for t in self.examples[i].input_ids]
        return self._texts[i]

    def scorable(self, i: int) -> np.ndarray:
        return ~np.asarray(self.examples[i].special, dtype=bool)

    def matches(self, i: int, matcher: UserPattern) -> np.ndarray:
        """Scored tokens of example i whose text fully matches ``matcher``."""
        texts = self.texts(i)
        return self.scorable(i) & np.array([bool(matcher.fullmatch(t)) for t in texts], dtype=bool)

    def layer(self, value: int | str, index: int, key: str) -> int:
        layer = {"first": 0, "last": self.n_layers - 1}.get(value, value)
        if not 0 <= layer < self.n_layers:
            raise InputError(f"{self.file.where(index, key)}: layer {value} does not exist: {self.pm.name} has "
                             f"{self.n_layers} layers in its {self.stack} attention (valid 0..{self.n_layers - 1}, "
                             "first or last)")
        return layer

    @overload
    def head(self, value: int, index: int, key: str) -> int: ...

    @overload
    def head(self, value: None, index: int, key: str) -> None: ...

    def head(self, value: int | None, index: int, key: str) -> int | None:
        if value is not None and not 0 <= value < self.n_heads:
            raise InputError(f"{self.file.where(index, key)}: head {value} does not exist: {self.pm.name} has "
                             f"{self.n_heads} heads per layer (valid 0..{self.n_heads - 1})")
        return value

    def check_ranking(self, ranking: AttentionRanking, index: int) -> tuple[int, int | None]:
        return self.layer(ranking.layer, index, "attention"), self.head(ranking.head, index, "attention")

    def attention_vectors(self, ranking: AttentionRanking, index: int) -> list[np.ndarray]:
        """One ``[tokens]`` vector per example: the method at the layer, the head or the head mean."""
        layer, head = self.check_ranking(ranking, index)
        out = []
        for s in self.scores(ranking.method).scores:
            v = s[layer]
            if v.dim() == 2:
                v = v[head] if head is not None else v.mean(dim=0)
            out.append(v.double().numpy())
        return out

    def sinks(self, threshold: float) -> SinkResult:
        """The examples' attention sinks at ``threshold`` (:func:`probe.explainers.sinks.attention_sinks`), found once."""
        key = f"sinks@{threshold!r}"
        if key not in self._scores:
            from probe.explainers.sinks import attention_sinks

            self._scores[key] = attention_sinks(self.pm, self.examples, threshold=threshold)
        return self._scores[key]

    def layer_window(self, window: int | str | list[int], index: int) -> list[int]:
        """An edge claim's ``layers`` (``window``, as written) as layer indices (each checked; a range's
        ends in order)."""
        ends, layers = parse_layer_window(window)
        if ends is None:
            return sorted({self.layer(layer, index, "layers") for layer in layers})
        start, stop = (self.layer(end, index, "layers") for end in ends)
        if start > stop:
            raise InputError(f"{self.file.where(index, 'layers')}: the range {window!r} runs from layer {start} "
                             f"down to {stop}; write the lower layer first")
        return list(range(start, stop + 1))

    def layer_ablation(self, layer: int) -> np.ndarray:
        """[example, 1 + heads]: the target unablated, then with each head of ``layer`` ablated alone."""
        if layer not in self._ablations:
            from probe.intervene.heads import ablate_heads

            ablations: list[list[tuple[int, int]]] = [[]] + [[(layer, h)] for h in range(self.n_heads)]
            self._ablations[layer] = ablate_heads(self.pm, self.examples, ablations, stack=self.stack).double().numpy()
        return self._ablations[layer]

    def reference(self, method: str) -> list[np.ndarray]:
        return [s.double().numpy() for s in self.scores(method).scores]

    def spans(self) -> list:
        """Each example's spans (the claim file's ``spans.pattern``), found once."""
        if "spans" not in self._spans:
            from probe.rows.spans import spans_per_example

            self._spans["spans"] = spans_per_example(self.pm, self.examples, self.file.spans.pattern)
        return self._spans["spans"]

    def span_vectors(self, vectors: list[np.ndarray]) -> list[np.ndarray]:
        """Token vectors (one per example) folded over each example's spans by ``spans.aggregate``."""
        import torch

        from probe.rows.spans import fold

        how = self.file.spans.aggregate
        return [np.array([float(fold(torch.from_numpy(v), s.positions, how)) for s in spans], dtype=np.float64)
                for v, spans in zip(vectors, self.spans())]

    def span_reference(self, method: str, index: int) -> list[np.ndarray]:
        """``method`` as leave-one-out of whole spans, one vector per example (span order)."""
        key = f"span:{method}"
        if key not in self._spans:
            from probe.intervene.spans import span_reference

            found = span_reference(self.engine, self.examples, self.spans(), method,
                                   {"seed": self.seed} if method in registry.seeded() else None)
            if found is None:
                raise InputError(f"{self.file.where(index, 'reference')}: {method} has no span form (a span is deleted "
                                 "or replaced by the mask, unk or pad token, or is a Shapley player); use loo_delete, "
                                 "loo_mask, loo_unk, loo_pad or shapley, or remove spans")
            self._spans[key] = found
        return self._spans[key]

    def describe(self, i: int) -> dict:
        """Prepared example ``i`` as the audit names it: its dataset example (and with a step target
        the output token it explains)."""
        example = self.examples[i]
        if example.step is None:
            item = self.items[i]
            return {"id": item.id, "text": item.text}
        item = self.items[self.owners[i]]
        return {"id": item.id, "text": item.text, "step": int(example.step), "output_token": example.label_name}
