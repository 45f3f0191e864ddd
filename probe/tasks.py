"""What kind of prediction a model makes, and everything probe decides from that: one class per task.

A :class:`Task` is what ``ProbeModel.task`` holds. The layers above read its fields instead of
comparing task names: which target kinds it takes and which it defaults to, whether its target is a
class label, a continuation fed after the input (next-token), tokens a decoder emits while reading
the input through cross-attention, or a pooled embedding; which attention stack the target query
reads; how long a row is once its target tokens are fed; and the sentences a result stores about
where the target query sits and where gradients enter.

A new task is one subclass here with its fields set, registered in :data:`TASKS`.

Bottom of the package (rank 0, with :mod:`probe.errors` and :mod:`probe.registry`): the hooks, the
models and every layer above may name it; it imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from probe.errors import InputError


class _Contract(Protocol):
    """What a task reads of a model's :class:`~probe.models.core.AttentionContract` (named, not
    imported: this module sits below the models layer)."""

    @property
    def primary_stack(self) -> str: ...


class Task:
    """One kind of prediction. Instances are singletons (``probe.tasks.TASKS``); compare them with ``is``, by
    ``.name``, or better by the field that decides the question at hand."""

    #: the name studies, claim files, the CLI (``--task``) and every stored result use
    name: ClassVar[str]
    #: what the model is, in a sentence's words ("classifier", "causal LM", ...)
    head: ClassVar[str]
    #: the auto class transformers loads such a checkpoint with (None: probe builds the class)
    auto_class: ClassVar[str | None] = None
    #: target kinds this task's examples may have, and the one they get when none is asked for
    kinds: ClassVar[tuple[str, ...]] = ("logprob", "prob", "logit")
    default_kind: ClassVar[str | None] = "logprob"
    #: the target is a class of the model's label head (label, gold labels, predicted labels, flips)
    labels: ClassVar[bool] = False
    #: the target is a continuation the model predicts token by token after the input, in the same
    #: sequence (continuation tokens are fed after the input; a shared prefix can be reused; the
    #: head is a next-token distribution: choices and ``lm`` replacements apply)
    next_token: ClassVar[bool] = False
    #: the target tokens come out of a decoder that reads the input through cross-attention
    encoder_decoder: ClassVar[bool] = False
    #: the model returns one pooled vector per row ([rows, classes] or [rows, hidden]), not one per position
    pooled: ClassVar[bool] = False
    #: the model's output is an embedding (similarity and dimension targets; no task head)
    embeds: ClassVar[bool] = False
    #: where the target query sits, as stored with every attention result (``params.target_query``)
    target_query_note: ClassVar[str]
    #: which tokens a gradient method attributes to, as stored with its result (``params.attributed``)
    attributed: ClassVar[str]

    @property
    def continuations(self) -> bool:
        """The target is output text (a continuation or a decoded output): ``--continuation`` applies."""
        return self.next_token or self.encoder_decoder

    def target_query_params(self, examples: Sequence) -> dict:
        """``params.target_query`` of an attention result on ``examples`` (prepared examples): this
        task's note, and where a language model explains its output token by token (``step``), each
        step's own query position (``target_query_positions``, one per example; -1: not a step)."""
        if not self.continuations or all(getattr(e, "step", None) is None for e in examples):
            return {"target_query": self.target_query_note}
        if self.encoder_decoder:  # a step's own decoder row alone
            positions = [-1 if e.step is None else e.step for e in examples]
            rule = ("seq2seq, output token by token: the cross-attention row of each output token's decoder "
                    "position (step")
        else:  # the row that predicts output token `step`: after the prompt and the output before it
            positions = [len(e.input_ids) - 1 + (e.step or 0) for e in examples]
            rule = ("causal LM, output token by token: the attention row that predicts each output token "
                    "(len(input_ids)-1+step")
        first = [p for e, p in zip(examples, positions) if e.step is not None][:6]
        more = ", ..." if sum(e.step is not None for e in examples) > len(first) else ""
        return {"target_query": f"{rule}; here positions {', '.join(map(str, first))}{more}; every example's in "
                                "target_query_positions)",
                "target_query_positions": positions}

    def target_stack(self, contract: _Contract) -> str:
        """The attention the target query reads the explained tokens through."""
        return "cross" if self.encoder_decoder else contract.primary_stack

    def input_stack(self, contract: _Contract) -> str:
        """The self-attention stack over the explained (input) tokens."""
        return "encoder" if self.encoder_decoder else contract.primary_stack

    def row_length(self, n_input: int, n_target: int) -> int:
        """Tokens one row costs in a forward: the input plus the target tokens it feeds."""
        if self.next_token:
            return n_input + n_target - 1  # the last continuation token is never fed
        if self.encoder_decoder:
            return n_input + n_target  # encoder + decoder
        return n_input

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            raise TypeError(f"a Task is not its name: compare task.name == {other!r}, or read the field that decides "
                            "(labels, next_token, encoder_decoder, pooled, embeds)")
        return self is other

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)

    def __repr__(self) -> str:
        return f"<task {self.name}>"

    def __reduce__(self):  # pickled (DataLoader workers, deep copies) as the registered singleton
        return task_named, (self.name,)


class Classification(Task):
    name = "classification"
    head = "classifier"
    auto_class = "AutoModelForSequenceClassification"
    default_kind = "prob"
    labels = True
    pooled = True
    target_query_note = ("classifier: attention row of the pooled position (0 = [CLS] for encoders, "
                         "last token for decoders)")
    attributed = "input tokens"


class CausalLM(Task):
    name = "causal_lm"
    head = "causal LM"
    auto_class = "AutoModelForCausalLM"
    next_token = True
    target_query_note = ("causal LM: attention row of the last explained token (position len(input_ids)-1), "
                         "which predicts the first continuation token")
    attributed = "prompt tokens (continuation held fixed)"


class Seq2Seq(Task):
    name = "seq2seq"
    head = "encoder-decoder"
    auto_class = "AutoModelForSeq2SeqLM"
    encoder_decoder = True
    target_query_note = ("seq2seq: cross-attention rows of the decoder positions that predict the output tokens, "
                         "averaged over those positions; keys are the encoder (explained) tokens")
    attributed = "encoder input tokens (decoder inputs held fixed)"


class Encoder(Task):
    name = "encoder"
    head = "headless encoder"
    kinds = ("similarity", "dimension")
    default_kind = None  # a similarity needs a reference text, a dimension its index: asked for, never assumed
    pooled = True
    embeds = True
    target_query_note = ("headless encoder: attention rows of the positions its pooling reads (every explained "
                         "token, averaged, for mean/max pooling; position 0 for cls pooling)")
    attributed = "input tokens (a similarity target's reference held fixed)"


#: every task by name, in the order help texts list them
TASKS: dict[str, Task] = {t.name: t() for t in (Classification, CausalLM, Seq2Seq, Encoder)}


def task_named(name: str | Task) -> Task:
    """The :class:`Task` called ``name`` (a Task is returned as it is); one-line error for another name."""
    if isinstance(name, Task):
        return name
    if name not in TASKS:
        raise InputError(f"unknown task {name!r}: use one of {', '.join(TASKS)}")
    return TASKS[name]
