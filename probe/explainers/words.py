"""Subword-to-word aggregation of token scores, for every method.

Models score subword tokens ("un", "##bel", "##ie", ...), people read words. :func:`word_groups`
says which token indices form each word of an example; :func:`aggregate` folds a score tensor's
last (token) axis into words; :func:`word_scores` does both for a whole :class:`TokenScores`.

Word boundaries come from the fast tokenizer's own pre-tokenisation (``word_ids()`` after
re-encoding the example's text), split further at whitespace seen in the character offsets (some
sentencepiece tokenizers have no pre-tokenizer and call the whole text one word). Only when the
re-encoded ids differ from ``example.input_ids`` (a perturbed row, a slow tokenizer) do the prefix
conventions of the token strings decide: WordPiece "##" continues a word; byte-level BPE "Ġ" and
sentencepiece "▁" start one. Special tokens are always words of their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from probe.display import CONTINUATION_PREFIX, WORD_START_PREFIXES
from probe.errors import InputError
from probe.rows.scores import TokenScores
from probe.rows.spans import fold

if TYPE_CHECKING:
    from probe.models.core import ProbeModel
    from probe.rows.target import PreparedExample

AGGREGATIONS = ("sum", "max", "mean")


def word_groups(pm: ProbeModel, example: PreparedExample) -> list[list[int]]:
    """Token indices of each word of ``example``, in order; every token in exactly one group."""
    ids = list(example.input_ids)
    special = list(example.special) if example.special else [False] * len(ids)
    from_tokenizer = _groups_from_offsets(pm.tokenizer, example.text, ids, special)
    if from_tokenizer is not None:
        return from_tokenizer
    tokens = list(example.tokens) if example.tokens else pm.tokenizer.convert_ids_to_tokens(ids)
    return groups_from_prefixes(tokens, special)


def _groups_from_offsets(tokenizer, text: str, ids: list[int], special: list[bool]) -> list[list[int]] | None:
    """Groups from the fast tokenizer's word ids and offsets, or None if they cannot be trusted."""
    if not getattr(tokenizer, "is_fast", False) or not text:
        return None
    # max_length=len(ids) reproduces a truncation done at encoding time and changes nothing otherwise
    encoding = tokenizer(text, return_offsets_mapping=True, truncation=True, max_length=max(len(ids), 1))
    if list(encoding["input_ids"]) != ids:
        return None
    word_ids = encoding.word_ids()
    offsets = encoding["offset_mapping"]
    groups: list[list[int]] = []
    previous_word = None
    for index, (word, (start, end)) in enumerate(zip(word_ids, offsets)):
        if word is None or special[index]:
            groups.append([index])
            previous_word = None
            continue
        same_word = word == previous_word
        if same_word:
            # whitespace before or at the start of this piece means a new word after all
            previous_end = offsets[index - 1][1]
            gap = text[previous_end:start] + text[start:end][:1]
            same_word = not any(ch.isspace() for ch in gap)
        if same_word:
            groups[-1].append(index)
        else:
            groups.append([index])
        previous_word = word
    return groups


def groups_from_prefixes(tokens: list[str], special: list[bool] | None = None) -> list[list[int]]:
    """Word groups from token strings alone (the fallback of :func:`word_groups`).

    WordPiece vocabularies ("##" pieces present) join a "##" piece to the word before it;
    BPE / sentencepiece ("Ġ" / "▁" pieces present) start a word at each marked piece and join
    unmarked pieces to the word before (punctuation included: "film," is then one word);
    anything else is one token per word.
    """
    special = special or [False] * len(tokens)
    plain = [t for t, s in zip(tokens, special) if not s]
    if any(t.startswith(CONTINUATION_PREFIX) for t in plain):
        def continues(token: str) -> bool:
            return token.startswith(CONTINUATION_PREFIX)
    elif any(t.startswith(WORD_START_PREFIXES) for t in plain):
        def continues(token: str) -> bool:
            return not token.startswith(WORD_START_PREFIXES)
    else:
        def continues(token: str) -> bool:
            return False
    groups: list[list[int]] = []
    open_word = False  # whether the last group is a word a piece may join
    for index, (token, is_special) in enumerate(zip(tokens, special)):
        if not is_special and open_word and continues(token):
            groups[-1].append(index)
        else:
            groups.append([index])
        open_word = not is_special
    return groups


def aggregate(scores: torch.Tensor, groups: list[list[int]], how: str = "sum") -> torch.Tensor:
    """Fold the last (token) axis of ``scores`` into words: ``[..., tokens] -> [..., words]``.

    Works for ``[tokens]``, ``[layer, head, tokens]`` and any other leading axes. NaN-aware: NaN
    tokens are ignored, and a word whose tokens are all NaN is NaN (not 0, which would read as
    "unimportant"). ``max`` takes the largest signed value: take ``abs()`` first for magnitudes.
    """
    if how not in AGGREGATIONS:
        raise InputError(f"unknown word aggregation {how!r}: use one of {', '.join(AGGREGATIONS)}")
    n_tokens = scores.shape[-1]
    flat = sorted(i for group in groups for i in group)
    if flat != list(range(n_tokens)) or any(not group for group in groups):
        raise InputError(f"word groups must cover each of the {n_tokens} tokens exactly once, got {groups!r}")
    return torch.stack([fold(scores, group, how) for group in groups], dim=-1)  # [..., words]


def word_rows(level: str, words: Sequence[tuple[str, Sequence[int]]], special: Sequence[bool],
              rows: Mapping[str, np.ndarray], how: str = "sum") -> tuple[list[str], list[bool], dict[str, np.ndarray]]:
    """A plot's ``[tokens]`` rows folded into ``words`` (``(text, token positions)``, as
    ``Explanation.word_groups`` gives them): the words' texts, whether each is special, the rows."""
    if level != "word":
        raise InputError(f"level={level!r} is not a level of the plot: use 'token' or 'word'")
    groups = [list(group) for _, group in words]
    folded = {label: aggregate(torch.as_tensor(values), groups, how).numpy() for label, values in rows.items()}
    return [text for text, _ in words], [bool(special[group[0]]) for group in groups], folded


def word_scores(pm: ProbeModel, examples: Sequence[PreparedExample], scores: TokenScores, how: str = "sum"
                ) -> TokenScores:
    """``scores`` folded into words for each example (same method name; params say how).

    ``extras``: ``word_groups`` (token indices per word), ``words`` (their text) and
    ``word_special`` (True for a word that is a special token), per example.
    """
    if len(examples) != len(scores.scores):
        raise InputError(f"{len(examples)} examples but {len(scores.scores)} score tensors: give the examples "
                         "the scores were computed on")
    all_groups, all_words, all_special, folded = [], [], [], []
    for example, tensor in zip(examples, scores.scores):
        groups = word_groups(pm, example)
        folded.append(aggregate(tensor, groups, how))
        tokens = list(example.tokens) or pm.tokenizer.convert_ids_to_tokens(list(example.input_ids))
        all_groups.append(groups)
        all_words.append([pm.tokenizer.convert_tokens_to_string([tokens[i] for i in g]).strip() for g in groups])
        all_special.append([len(g) == 1 and bool(example.special[g[0]]) for g in groups])
    extras = {**scores.extras, "word_groups": all_groups, "words": all_words, "word_special": all_special}
    return TokenScores(method=scores.method, scores=folded, params={**scores.params, "word_aggregation": how},
                       per_head=scores.per_head, per_layer=scores.per_layer, extras=extras)


#: the columns of :func:`word_table` (``Explanation.to_pandas(level="word")``)
WORD_COLUMNS = ["example", "word_index", "word", "first_position", "n_tokens", "special", "method", "layer", "head",
                "score"]


def word_table(results: Sequence[tuple[str, TokenScores]], words: Sequence[Sequence[tuple[str, tuple[int, ...]]]],
               special: Sequence[Sequence[bool]], agg: str) -> pd.DataFrame:
    """One row per (example, method, layer, head, word): each method's token scores folded by ``agg``
    over example i's ``words[i]`` (text, token positions); a word is ``special`` where it is one
    special token (``special[i]``)."""
    if agg not in AGGREGATIONS:
        raise InputError(f"agg={agg!r} is not a word aggregation: use one of {', '.join(AGGREGATIONS)}")
    frames = []
    for method, result in results:
        for i in range(len(result.scores)):
            groups = [list(g) for _, g in words[i]]
            folded = TokenScores(method, [aggregate(result.scores[i], groups, agg)],
                                 per_head=result.per_head, per_layer=result.per_layer)
            frame = folded.to_pandas().rename(columns={"position": "word_index"})
            at = frame["word_index"].to_numpy()
            frame["example"] = i
            frame["word"] = np.array([text for text, _ in words[i]], dtype=object)[at]
            frame["first_position"] = np.array([g[0] for _, g in words[i]], dtype=np.int64)[at]
            frame["n_tokens"] = np.array([len(g) for _, g in words[i]], dtype=np.int64)[at]
            frame["special"] = np.array([len(g) == 1 and bool(special[i][g[0]]) for _, g in words[i]], dtype=bool)[at]
            frame["method"] = method
            frames.append(frame[WORD_COLUMNS])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=WORD_COLUMNS)
