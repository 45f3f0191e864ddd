"""Factory of tiny, randomly initialised transformer models for offline tests.

Every model is built from a config written in code (nothing touches a model hub),
given a small word-level tokenizer, and saved to a folder so that

    AutoTokenizer.from_pretrained(folder)
    AutoModelFor<Task>.from_pretrained(folder)

load it offline.  Building one takes a fraction of a second.

Usage::

    from tiny_models import build_tiny, load_tiny, TINY_KINDS, TINY_AUTO_CLASS
    folder = build_tiny("bert", tmp_path / "bert")      # or use the `tiny_dirs` fixture
    model, tok = load_tiny("bert", folder, attn_implementation="eager")

(``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so ``import tiny_models`` works.)

The query/key projections are scaled up after the random init so attention maps
are peaked (not near-uniform), which makes attention-equality tests meaningful
(see :func:`_sharpen_attention`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel

TINY_KINDS = ("bert", "gpt2", "llama_gqa", "bart", "t5")
#: kinds build_tiny also makes, on demand only (not in the session's ``tiny_dirs``): token mixers
#: read as implicit attention (probe.hooks.implicit), which have no query/key weights to sharpen
ON_DEMAND_KINDS = ("mamba",)

#: Name of the ``transformers`` Auto class that loads each kind.
TINY_AUTO_CLASS = {
    "bert": "AutoModelForSequenceClassification",
    "gpt2": "AutoModelForCausalLM",
    "llama_gqa": "AutoModelForCausalLM",
    "bart": "AutoModelForSeq2SeqLM",
    "t5": "AutoModelForSeq2SeqLM",
    "mamba": "AutoModelForCausalLM",
}

#: Word-level vocabulary shared by every tiny tokenizer (special tokens come first,
#: per kind).  ~60 common English words plus the words used in the tests.
WORDS = (
    # punctuation
    ".", ",", "!", "?", "'",
    # common function words
    "the", "a", "an", "and", "or", "but", "not", "no", "is", "was", "are", "were",
    "be", "been", "it", "this", "that", "of", "to", "in", "on", "at", "for",
    "with", "as", "by", "from", "i", "you", "he", "she", "we", "they", "my",
    "his", "her", "their", "very", "so", "too", "really", "quite", "all",
    "some", "just", "than", "then", "there", "what", "who", "if", "have", "had",
    "do", "did",
    # content words used by tests (sentiment / reviews)
    "movie", "film", "story", "plot", "acting", "actor", "actors", "director",
    "ending", "scene", "scenes", "music", "book", "cat", "dog", "sat", "mat",
    "good", "great", "bad", "terrible", "awful", "excellent", "wonderful",
    "boring", "fun", "funny", "brilliant", "amazing", "horrible", "best",
    "worst", "love", "loved", "hate", "hated", "like", "liked", "enjoyed",
    "time", "waste", "long", "short", "slow", "fast", "nice", "poor",
    "would", "recommend", "again", "watch", "saw", "never", "ever", "much",
    "paris", "france", "capital", "city", "hello", "world", "yes",
)

MAX_POSITIONS = 64
#: Target std of the attention logits after :func:`_sharpen_attention` (peaked, not one-hot).
ATTN_LOGIT_STD = 3.0

# per-kind special tokens, in id order
_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_GPT2_SPECIALS = ("<|endoftext|>",)
_LLAMA_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
_BART_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
_T5_SPECIALS = ("<pad>", "</s>", "<unk>")


def _vocab(specials: tuple[str, ...]) -> dict[str, int]:
    tokens = list(specials) + [w for w in WORDS if w not in specials]
    assert len(set(tokens)) == len(tokens), "duplicate word in WORDS"
    return {t: i for i, t in enumerate(tokens)}


def _word_level_tokenizer(
    vocab: dict[str, int],
    unk: str,
    *,
    template: tuple[str, ...] | None = None,
    bert_pre: bool = False,
) -> Tokenizer:
    """A lowercasing, whitespace/punctuation-splitting word-level tokenizer.

    ``template``: ``(prefix, suffix)`` special tokens wrapped around every sequence
    (either may be ``None``).
    """
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=unk))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents()])
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer() if bert_pre else pre_tokenizers.Whitespace()
    if template is not None:
        prefix, suffix = template
        single = " ".join(x for x in (prefix, "$A", suffix) if x)
        pair = " ".join(x for x in (prefix, "$A", suffix, "$B:1", suffix and f"{suffix}:1") if x)
        specials = [(t, vocab[t]) for t in dict.fromkeys(x for x in (prefix, suffix) if x)]
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return tok


def _wrap(tok: Tokenizer, **special_tokens):
    from transformers import (
        PreTrainedTokenizerFast,  # alias of TokenizersBackend in transformers 5
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=MAX_POSITIONS,
        padding_side="right",
        **special_tokens,
    )
    return fast


# ---------------------------------------------------------------------------
# per-kind builders: each returns (model, tokenizer)
# ---------------------------------------------------------------------------


def _build_bert():
    from transformers import BertConfig, BertForSequenceClassification

    vocab = _vocab(_BERT_SPECIALS)
    tok = _wrap(
        _word_level_tokenizer(vocab, "[UNK]", template=("[CLS]", "[SEP]"), bert_pre=True),
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],  # as BertTokenizer
    )
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_POSITIONS,
        type_vocab_size=2,
        num_labels=2,
        id2label={0: "NEGATIVE", 1: "POSITIVE"},
        label2id={"NEGATIVE": 0, "POSITIVE": 1},
        pad_token_id=vocab["[PAD]"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    # With the default init (std 0.02) the pooler + classifier give logits of ~0.01, so
    # both classes are almost tied; use fan-in init there so logits are O(1).
    with torch.no_grad():
        for layer in (model.bert.pooler.dense, model.classifier):
            layer.weight.normal_(0.0, layer.in_features**-0.5)
    return model, tok


def _build_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = _vocab(_GPT2_SPECIALS)
    eot = "<|endoftext|>"
    tok = _wrap(
        _word_level_tokenizer(vocab, eot),
        bos_token=eot,
        eos_token=eot,
        pad_token=eot,
        unk_token=eot,
    )
    config = GPT2Config(
        vocab_size=len(vocab),
        n_positions=MAX_POSITIONS,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab[eot],
        eos_token_id=vocab[eot],
        pad_token_id=vocab[eot],
    )
    return GPT2LMHeadModel(config), tok


def _build_llama_gqa():
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = _vocab(_LLAMA_SPECIALS)
    # Llama tokenizers prepend <s> (no </s>) to every sequence.
    tok = _wrap(
        _word_level_tokenizer(vocab, "<unk>", template=("<s>", None)),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(config), tok


def _build_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    vocab = _vocab(_BART_SPECIALS)
    tok = _wrap(
        _word_level_tokenizer(vocab, "<unk>", template=("<s>", "</s>")),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        cls_token="<s>",
        sep_token="</s>",
    )
    config = BartConfig(
        vocab_size=len(vocab),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        decoder_start_token_id=vocab["</s>"],  # as in facebook/bart-*
        forced_eos_token_id=vocab["</s>"],
    )
    return BartForConditionalGeneration(config), tok


def _build_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    vocab = _vocab(_T5_SPECIALS)
    tok = _wrap(
        _word_level_tokenizer(vocab, "<unk>", template=(None, "</s>")),
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    config = T5Config(
        vocab_size=len(vocab),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["</s>"],
        decoder_start_token_id=vocab["<pad>"],  # T5 convention
    )
    return T5ForConditionalGeneration(config), tok


def _build_mamba():
    from transformers import MambaConfig, MambaForCausalLM

    tok, vocab = eot_tokenizer(_GPT2_SPECIALS)
    eot = "<|endoftext|>"
    config = MambaConfig(vocab_size=len(vocab), hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                         conv_kernel=4, bos_token_id=vocab[eot], eos_token_id=vocab[eot], pad_token_id=vocab[eot])
    model = MambaForCausalLM(config)
    fan_in_init(model)
    return model, tok


def eot_tokenizer(specials: tuple[str, ...] = ("<|endoftext|>",)):
    """(a word-level tokenizer whose bos, eos, pad and unk are all the first of ``specials``, as
    GPT-2's end-of-text token is; its vocabulary) for the tiny token-mixer models of the tests."""
    eot = specials[0]
    vocab = _vocab(specials)
    return _wrap(_word_level_tokenizer(vocab, eot), bos_token=eot, eos_token=eot, pad_token=eot, unk_token=eot), vocab


def mixer_inputs(model, inputs: dict) -> dict:
    """{path: (module, hidden, mask, own output)} of every mixer ``probe.hooks.implicit`` reads, in one
    forward pass of ``inputs`` (the module's inputs as its forward hook sees them)."""
    from probe.hooks import implicit

    seen, handles = {}, []
    for path, _ in implicit.find_mixers(model):
        def keep(mod, args, kwargs, output, path=path):
            seen[path] = (mod, *implicit.call_inputs(mod, args, kwargs), output)

        handles.append(model.get_submodule(path).register_forward_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def fan_in_init(model, bias_std: float | None = None) -> None:
    """Every linear layer but the output head drawn N(0, 1/fan_in) (and its bias N(0, bias_std^2)
    where given), in module order: with the default init (std 0.02) a tiny mixer's output, and so
    its effect, is about 0."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.normal_(0.0, module.in_features ** -0.5)
                if bias_std is not None and module.bias is not None:
                    module.bias.normal_(0.0, bias_std)


_BUILDERS = {
    "bert": _build_bert,
    "gpt2": _build_gpt2,
    "llama_gqa": _build_llama_gqa,
    "bart": _build_bart,
    "t5": _build_t5,
    "mamba": _build_mamba,
}

# names of the query/key projection weights, per kind (matched on the parameter name suffix)
_QK_SUFFIXES = {
    "bert": ("attention.self.query.weight", "attention.self.key.weight"),
    "llama_gqa": ("self_attn.q_proj.weight", "self_attn.k_proj.weight"),
    "bart": ("q_proj.weight", "k_proj.weight"),
    "t5": (".q.weight", ".k.weight"),
}


def _qk_weight_std(kind: str, model: torch.nn.Module, logit_std: float) -> float:
    """Std of the q and k projection weights giving attention logits of std ~``logit_std``.

    The inputs of every attention block are (RMS/Layer)-normalised, so their components
    have unit variance.  With i.i.d. weights of std ``s`` the query and key components
    have std ``s * sqrt(hidden)``; the logit ``q.k / sqrt(d_head)`` then has std
    ``s**2 * hidden``.  T5 does not divide by ``sqrt(d_head)``, so there it is
    ``s**2 * hidden * sqrt(d_head)``.
    """
    cfg = model.config
    hidden = cfg.d_model if kind in ("bart", "t5") else cfg.hidden_size
    var = logit_std / hidden
    if kind == "t5":
        var /= cfg.d_kv**0.5
    return var**0.5


@torch.no_grad()
def _sharpen_attention(kind: str, model: torch.nn.Module, logit_std: float = ATTN_LOGIT_STD) -> int:
    """Rescale query and key projection weights so attention logits have std ~``logit_std``.

    The default init (std 0.02, hidden 32) gives logits of std ~0.01, i.e. near-uniform
    attention; a fixed factor of ~3 is not enough (x9 on the logits), so each q/k
    weight is multiplied by the factor that brings its std to the value computed by
    :func:`_qk_weight_std` (about x15 for BERT/GPT-2/Llama/BART; about x3 for the T5 queries and x1 for its keys,
    which T5 already initialises larger).
    Returns how many tensors were rescaled.
    """
    target = _qk_weight_std(kind, model, logit_std)

    def rescale(w: torch.Tensor) -> None:
        w.mul_(target / w.std())

    n = 0
    if kind == "gpt2":
        # GPT-2 fuses q, k, v in one Conv1D ``c_attn`` with weight [n_embd, 3 * n_embd] (in, out)
        for name, module in model.named_modules():
            if name.endswith("attn.c_attn"):
                e = module.weight.shape[0]
                assert module.weight.shape[1] == 3 * e
                rescale(module.weight[:, :e])
                rescale(module.weight[:, e : 2 * e])
                module.bias[: 2 * e].zero_()  # already zero after init; keep q/k bias-free
                n += 2
        return n
    suffixes = _QK_SUFFIXES[kind]
    for name, param in model.named_parameters():
        if name.endswith(suffixes):
            rescale(param)
            n += 1
    return n


def build_tiny(kind: str, folder: Path, seed: int = 0, *, attn_logit_std: float | None = ATTN_LOGIT_STD) -> Path:
    """Build a tiny random model of ``kind`` (one of ``TINY_KINDS``) and save it with its tokenizer.

    Returns ``folder`` (created if needed).  Deterministic for a given ``seed``.
    ``attn_logit_std=None`` keeps the library's own (near-uniform attention) init.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS + ON_DEMAND_KINDS}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model, tok = _BUILDERS[kind]()
    if attn_logit_std is not None and kind not in ON_DEMAND_KINDS:
        changed = _sharpen_attention(kind, model, attn_logit_std)
        assert changed > 0, f"no query/key weights found to sharpen for {kind}"
    model.eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    _strip_attn_implementation(folder)
    return folder


def _strip_attn_implementation(folder: Path) -> None:
    """Make sure the saved config does not pin an attention implementation."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    dirty = False
    for key in ("attn_implementation", "_attn_implementation", "_attn_implementation_autoset"):
        if key in cfg:
            del cfg[key]
            dirty = True
    if dirty:
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_tiny(kind: str, folder: Path, **model_kwargs):
    """Load ``(model, tokenizer)`` from a folder made by :func:`build_tiny` (model in eval mode)."""
    import transformers

    auto = getattr(transformers, TINY_AUTO_CLASS[kind])
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = auto.from_pretrained(folder, **model_kwargs).eval()
    return model, tok
